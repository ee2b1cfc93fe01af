"""The rings' ports of a fleet's pipelines, kept apart.

``mlx.launch``'s ring backend gives each rank one port per address, counting up from the first port
(``cluster.doctor.ring_ports``). Two pipelines that start from the same port collide on a host they share (and on
this machine, where local ranks live): so the fleet's pipelines take consecutive ranges, each starting where the
one before ends. Where the first range starts (``--ring-port``, else a free port when every rank is local, as one
pipeline's, else mlx.launch's) is the launching command's to say (``cli.fleet``): this room stands below
``launch/``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpipe.cluster.hostfile import Hostfile


def ports_needed(hostfile: Hostfile) -> int:
    """The ports a pipeline on ``hostfile`` takes: one per rank and address (one for a rank without any)."""
    return sum(max(1, len(h.ips)) for h in hostfile.hosts)


def all_local(pipelines: Sequence[Hostfile]) -> bool:
    """Whether every rank of every pipeline runs on this machine (then the ranges start at a free port)."""
    return all(h.is_local for hostfile in pipelines for h in hostfile.hosts)


def first_ports(pipelines: Sequence[Hostfile], base: int) -> list[int]:
    """Each pipeline's first ring port, their ranges one after the other from ``base``."""
    starts, port = [], base
    for hostfile in pipelines:
        starts.append(port)
        port += ports_needed(hostfile)
    return starts
