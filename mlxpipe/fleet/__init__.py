"""Fleets: several models served by one endpoint, each on its own hosts of one hostfile (``serve --fleet``).

``spec`` reads and checks the fleet file (each entry's model, hosts, names, replicas and per-model options) against
the cluster's hostfile; ``plan`` plans every entry as ``mlxpipe plan`` plans one model and checks that the hosts
hold everything they are given together; ``ports`` keeps the entries' rings apart. The HTTP side, one endpoint that
routes each request by its model name, is ``mlxpipe.serve.router``.
"""
