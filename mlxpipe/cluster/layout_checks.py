"""The doctor's checks of the layout rather than of a host: a tensor-parallel group's links, and the layout against
fewer hosts as the cluster's measured facts predict them.

* ``tp links`` (with ``--tp``): a tensor-parallel group does two all-reduces per layer per token, so its
  speed is its links' latency: a group whose hosts talk over TCP (the ring backend, or MPI, over
  Ethernet) gets a warning pointing to JACCL over Thunderbolt 5 RDMA. A group on one machine needs no
  network.
* ``layout`` (with a model and the cluster's measured facts): a warning, with the predicted figures of
  both, when the layout is predicted slower than the hostfile's first hosts alone would be
  (``plan/choose.py``: "adding a Mac made it slower", said before the run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxpipe.cluster.check_result import OK, WARN, CheckResult
from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan

if TYPE_CHECKING:
    from mlxpipe.cluster.target import Target

# Backends whose ranks reach each other over RDMA (Thunderbolt 5: JACCL) or a GPU fabric (NCCL), not TCP.
FAST_BACKENDS = ("jaccl", "jaccl-ring", "nccl")


def tp_link_checks(hostfile: Hostfile, tp: int, backend: str) -> list[CheckResult]:
    """Each tensor-parallel group's links: a warning for a group that spans machines over TCP."""
    from mlxpipe.plan.tensor import groups

    if tp == 1:
        return []
    results = []
    for g, ranks in enumerate(groups(hostfile.size, tp)):
        members = [hostfile.hosts[r] for r in ranks]
        machines = list(dict.fromkeys(h.ssh for h in members))
        label = f"stage {g} (ranks {ranks[0]}-{ranks[-1]})"
        if len(machines) == 1:
            status, detail, fix = OK, f"{label}: one machine, no network between its members", None
        elif backend in FAST_BACKENDS:
            status, detail, fix = OK, f"{label} spans {', '.join(machines)} over {backend}", None
        else:
            status = WARN
            detail = (f"{label} spans {', '.join(machines)} over TCP ({backend} backend): a tensor-parallel "
                      "group does two all-reduces per layer per token, so TCP latency (Ethernet, or IP over "
                      "Thunderbolt) can make it slower than one machine")
            fix = ("link the group's Macs with Thunderbolt 5 and use JACCL (RDMA): "
                   "`mlx.distributed_config --backend jaccl --over thunderbolt` writes the hostfile; "
                   "or keep --tp groups on one machine and pipeline across the slower links")
        results.append(CheckResult(members[0].ssh, tuple(ranks), "tp links", status, detail, fix))
    return results


def layout_checks(target: Target, meta: ModelMetadata, plan: Plan, backend: str | None = None) -> list[CheckResult]:
    """The plan's layout against the hostfile's first hosts alone, as the cluster's facts predict them; nothing
    without facts."""
    from mlxpipe.cluster.facts_file import load_facts
    from mlxpipe.plan.choose import Candidate, fewer_hosts
    from mlxpipe.plan.estimate import Costing, estimate
    from mlxpipe.plan.model_work import model_work
    from mlxpipe.plan.parallel_layout import Layout

    hostfile = target.hostfile
    facts, _ = load_facts(hostfile)
    if facts is None or hostfile.size < 2:
        return []
    chosen = backend or target.preset.backend or hostfile.backend or "ring"
    layout = Layout(plan.tp, plan.split, plan.strategy, hostfile.size)
    mine = Candidate(layout, plan, estimate(Costing(model_work(meta), facts, chosen), layout, target.workload),
                     (plan.strategy,))
    better = fewer_hosts(meta, hostfile.hosts, mine, target.workload, facts=facts, backend=chosen,
                         context=plan.context)
    first = hostfile.hosts[0]
    here = f"{mine.name} on {hostfile.size} hosts: {_figures(mine.estimate)}"
    if better is None:
        return [CheckResult(first.ssh, tuple(range(hostfile.size)), "layout", OK,
                            f"{here}; no layout on fewer of these hosts is predicted faster")]
    k = better.layout.hosts
    alone = ", ".join(h.ssh for h in hostfile.hosts[:k])
    return [CheckResult(
        first.ssh, tuple(range(hostfile.size)), "layout", WARN,
        f"predicted slower than fewer hosts: {here}; {better.name} on the first {k} ({alone}): "
        f"{_figures(better.estimate)} ({target.workload.describes})",
        f"run on {alone} alone (a hostfile of {'it' if k == 1 else 'them'}), or see `mlxpipe plan --layout auto` "
        "for a faster layout of every host")]


def _figures(e: Any) -> str:
    return (f"{e.decode:.1f} tok/s decode, {e.prefill:.1f} tok/s prefill, {e.aggregate:.1f} tok/s at "
            f"{e.concurrency} at once, {e.score:.2f} s a request")
