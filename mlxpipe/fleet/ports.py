"""The rings' ports of a fleet's pipelines, kept apart.

``mlx.launch``'s ring backend gives each rank one port per address, counting up from the first port
(``cluster.doctor.ring_ports``). Two pipelines that start from the same port collide on a host they share (and on
this machine, where local ranks live): so the fleet's pipelines take consecutive ranges, each starting where the
one before ends. On a cluster of local ranks alone the ranges start at a free port, as one pipeline's do.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.defaults import DEFAULT_PORT


def ports_needed(hostfile: Hostfile) -> int:
    """The ports a pipeline on ``hostfile`` takes: one per rank and address (one for a rank without any)."""
    return sum(max(1, len(h.ips)) for h in hostfile.hosts)


def first_ports(pipelines: Sequence[Hostfile], base: int | None = None) -> list[int]:
    """Each pipeline's first ring port, their ranges one after the other from ``base`` (``--ring-port``), else
    from a free port when every rank is local, else from mlx.launch's."""
    from mlxpipe.launch.ranks import free_port_base

    counts = [ports_needed(h) for h in pipelines]
    if base is None:
        local = all(h.is_local for hostfile in pipelines for h in hostfile.hosts)
        base = free_port_base(sum(counts)) if local else DEFAULT_PORT
    starts, port = [], base
    for count in counts:
        starts.append(port)
        port += count
    return starts
