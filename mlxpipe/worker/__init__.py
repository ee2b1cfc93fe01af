"""The per-rank worker that ``mlx.launch`` runs on every host.

``python -m mlxpipe.worker --job <base64 JSON>`` (``__main__``) joins the job's
group (``groups``), loads this rank's layers (``load``), cut into stages
(``stages``) and, with ``--tp``, sliced across the stage's group (``tensor``),
then runs the rank for its job: serving (``generation``: requests overlapped
in the engine, or one at a time through mlx-lm, with the prompt cache's tiers
and batch caches of ``caches``) or LoRA training (``training``);
``python -m mlxpipe.worker --links N`` is a links job's rank, which loads no
model (``measure``). What a rank reads and writes is ``mlxpipe.protocol``'s;
these modules import MLX.

Beside the rooms, what every kind of rank shares: ``inbox`` (the numbered
standard input), ``progress`` (the stall watchdog's reports), ``agree`` (the
ranks' tiny agreeing collectives), ``context`` (what a serving rank's request
loops read) and ``vision`` (a vision-language model loaded on a rank).
"""
