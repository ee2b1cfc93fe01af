"""The per-rank worker that ``mlx.launch`` runs on every host.

``python -m mlxpipe.worker --job <base64 JSON>`` loads this rank's layers
(``load``), cuts the model into stages (``stages``) and answers the controller's
messages in the rank loop (``loop``: requests overlapped in the ``engine``, or one
at a time through mlx-lm in ``streamed``; ``train`` for LoRA). What it reads and
writes is ``mlxpipe.protocol``'s; these modules import MLX.
"""
