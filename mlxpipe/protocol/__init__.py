"""The contract between the controller and the ranks, which both sides import.

``wire`` carries it (lines through ``mlx.launch``'s standard input and the ranks'
output); ``job`` is what every rank runs (``JobSpec``, on its command line);
``request`` one generation request, typed.

Light on purpose: the ranks' supervisors, the download script on every host and
``mlxpipe --help`` import it, so nothing here imports MLX or the launch code.
"""
