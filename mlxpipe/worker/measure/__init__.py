"""What a links job's ranks measure for ``mlxpipe doctor --links`` (and ``cluster init``): no model, the machines.

A links job starts one rank per host, as a pipeline would, but loads nothing:
each rank answers the controller's measurements one at a time
(``link_probe``: its machine's memory bandwidth and matrix rate, the latency and
bandwidth of its links to its neighbours, the per-tick collective) and, with
``--calibrate``, what real transformer layers reach on its machine
(``calibrate``). The controller's side, which turns the figures into the
cluster's facts file, is ``mlxpipe.cluster.links``.

The rooms: ``link_probe`` (the links job's rank and its measurements) and
``calibrate`` (mlx-lm's own layers timed, the per-layer and per-pass costs
taken apart).
"""
