"""The per-rank worker that ``mlx.launch`` runs on every host.

``python -m mlxpipe.worker --job <base64 JSON>`` loads this rank's layers
(``load``), pipelines them (``pipeline``) and answers the controller's
requests (``serve``). ``job`` is light and safe for the controller to import;
the other modules import MLX.
"""
