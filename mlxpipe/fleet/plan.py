"""A fleet's plan: every entry's pipeline planned as ``mlxpipe plan`` plans one model, and the hosts checked against
everything they are given together.

Each replica of each entry is planned over its own hosts as a hostfile of their own (``Fleet.replica_hostfile``),
with the planner every command uses (``cluster.target.plan_target``). A host that two entries share runs a rank of
each, side by side: it must hold both ranks' weights, runtime and KV caches within its one budget, which no single
plan can see (``shortfalls``). Pure apart from the links' facts each plan reads beside the hostfile: the models'
metadata is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.cluster.presets import Preset
from mlxpipe.cluster.target import Target, plan_target, settle_layout
from mlxpipe.defaults import DEFAULT_CONTEXT
from mlxpipe.fleet.spec import Fleet, FleetEntry
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.parallel_layout import DEFAULT_WORKLOAD, Workload
from mlxpipe.plan.shard import Plan


@dataclass(frozen=True)
class Placed:
    """One pipeline of the fleet: an entry's replica, on these hosts of the cluster (indices, in rank order)."""

    entry: FleetEntry
    replica: int
    hosts: tuple[int, ...]
    plan: Plan

    @property
    def label(self) -> str:
        """``small`` or, for an entry of several replicas, ``small#1``."""
        return self.entry.replica_label(self.replica)


@dataclass(frozen=True)
class Shortfall:
    """A host that cannot hold everything the fleet gives it: what it would hold, its budget, and whose ranks."""

    host: int  # index in the cluster's hostfile
    ssh: str
    need_bytes: int
    budget_bytes: int
    holders: tuple[str, ...]  # the pipelines (``Placed.label``) with a rank there

    @property
    def lacks_bytes(self) -> int:
        return self.need_bytes - self.budget_bytes


@dataclass(frozen=True)
class FleetPlan:
    """Every pipeline's plan, and the hosts that cannot hold their ranks together."""

    placed: tuple[Placed, ...]
    shortfalls: tuple[Shortfall, ...]

    @property
    def fits(self) -> bool:
        return not self.shortfalls and all(p.plan.fits for p in self.placed)

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "pipelines": [{"entry": p.entry.index, "model": p.entry.model, "names": list(p.entry.model_names),
                           "replica": p.replica, "hosts": list(p.hosts), "plan": p.plan.to_json()}
                          for p in self.placed],
            "shortfalls": [{"host": s.host, "ssh": s.ssh, "need_bytes": s.need_bytes, "budget_bytes": s.budget_bytes,
                            "lacks_bytes": s.lacks_bytes, "holders": list(s.holders)} for s in self.shortfalls],
        }


def entry_target(fleet: Fleet, entry: FleetEntry, replica: int, workload: Workload = DEFAULT_WORKLOAD) -> Target:
    """What one replica of ``entry`` works on, as ``resolve_target`` makes it of flags: ``tp`` and ``layout`` from
    the entry (auto unless it gives ``tp``), its errors naming the fleet file."""
    with fleet.errors_of(entry):
        return Target(
            model=entry.model, revision=entry.revision, hostfile=fleet.replica_hostfile(entry, replica),
            strategy=entry.strategy, split=None, preset=Preset(), tp=entry.tp or 1,
            tp_flag=f"{fleet.where(entry)}: 'tp'", layout=entry.layout or ("pipeline" if entry.tp else "auto"),
            layout_asked=entry.layout is not None, workload=workload,
        )


def entry_context(entry: FleetEntry, context: int | None) -> int:
    """The context ``entry``'s fit check reserves KV cache for: its own, else the command's, else the default."""
    return entry.context or context or DEFAULT_CONTEXT


def plan_fleet(fleet: Fleet, metas: Mapping[int, ModelMetadata], *, context: int | None = None,
               backend: str | None = None, workload: Workload = DEFAULT_WORKLOAD) -> FleetPlan:
    """Plan every replica of every entry (``metas``: each entry's model, by the entry's index), then check the
    hosts they share."""
    placed = []
    for entry in fleet.entries:
        meta = metas[entry.index]
        ctx = entry_context(entry, context)
        for replica, hosts in enumerate(entry.groups()):
            target = entry_target(fleet, entry, replica, workload)
            with fleet.errors_of(entry):
                settled = settle_layout(target, meta, context=ctx, backend=backend).target
                placed.append(Placed(entry, replica, hosts, plan_target(settled, meta, context=ctx, backend=backend)))
    return FleetPlan(tuple(placed), tuple(shortfalls(placed, fleet.hostfile)))


def shortfalls(placed: Sequence[Placed], hostfile: Hostfile) -> list[Shortfall]:
    """The hosts with ranks of two or more pipelines whose needs together exceed the host's budget (a host of one
    pipeline is its plan's own fit check). A host without a known budget cannot be checked."""
    need: dict[int, int] = {}
    holders: dict[int, list[str]] = {}
    budget: dict[int, int] = {}
    for p in placed:
        for index, rank in zip(p.hosts, p.plan.ranks, strict=True):
            holders.setdefault(index, []).append(p.label)
            if rank.budget_bytes is not None and rank.headroom_bytes is not None:
                budget[index] = rank.budget_bytes
                need[index] = need.get(index, 0) + rank.budget_bytes - rank.headroom_bytes
    return [Shortfall(i, hostfile.hosts[i].ssh, need[i], budget[i], tuple(holders[i]))
            for i in sorted(need) if len(holders[i]) > 1 and need[i] > budget[i]]
