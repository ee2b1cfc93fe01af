"""The per-rank worker that ``mlx.launch`` runs on every host.

``python -m mlxpipe.worker --job <base64 JSON>`` loads this rank's layers
(``load``), pipelines them (``pipeline``) and answers the controller's
requests (``requests``: overlapped in the ``engine``, or one at a time through
mlx-lm in ``streamed``; ``train`` for LoRA). ``job`` is light and safe for the controller to import;
the other modules import MLX.
"""
