"""The shard plan: which layers each rank runs, what it must hold and fetch.

Pure functions over plain data (the model's metadata and the hostfile): no MLX,
no network, so planning is instant and exhaustively testable.

mlx-lm's convention holds throughout: rank 0 runs the LAST layers and the
highest rank the FIRST (``mlx_lm.models.pipeline.PipelineMixin.pipeline``), and
a split lists layers per rank in rank order.

With tensor parallelism (``tp`` > 1, see ``plan/tensor.py``) the split lists layers per
STAGE, a stage being a group of ``tp`` consecutive ranks: the strategies work over the
stages, each stage's budget that of its smallest member, and every member gets a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mlxpipe.defaults import DEFAULT_CONTEXT
from mlxpipe.errors import PlanError, UsageError
from mlxpipe.host import Host
from mlxpipe.model.facts import kv_sharing_groups
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan import tensor
from mlxpipe.plan.cluster_facts import ClusterFacts
from mlxpipe.plan.costs import (
    RUNTIME_OVERHEAD,
    Costs,
    active_experts,
    budget_bytes,
    kv_bytes,
    max_context,
    model_costs,
    rank_weight_bytes,
)
from mlxpipe.plan.estimate import Costing, phase_costs
from mlxpipe.plan.model_work import model_work
from mlxpipe.plan.parallel_layout import DEFAULT_WORKLOAD, Workload
from mlxpipe.plan.splits import (
    check_groups,
    choose_split,
    cut_group,
    layer_ranges,
    legal_split,
    proportional_split,
)


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs and needs."""

    rank: int
    host: str
    start: int  # first layer (inclusive)
    end: int  # last layer (exclusive)
    weight_bytes: int  # its layers plus the tensors every rank keeps
    files: tuple[str, ...]  # weight files it needs
    download_bytes: int  # those files plus config and tokenizer files
    kv_bytes_per_1k: int  # KV cache per 1,000 tokens of context
    work_share: float  # its share of the pipeline's work per token (weight bytes read; the head on rank 0)
    budget_bytes: int | None  # memory the GPU may use on that host
    headroom_bytes: int | None  # budget - weights - overhead - KV at the planned context
    fits: bool | None
    max_context: int | None
    stage: int = 0  # the pipeline stage: rank // tp (without --tp, the rank itself)
    tp_index: int = 0  # its place in the stage's tensor-parallel group: rank % tp

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    """A complete, validated shard plan."""

    model: str
    commit: str | None
    strategy: str
    num_layers: int
    context: int
    split: tuple[int, ...]  # layers per stage, stage order (per rank without --tp)
    ranks: tuple[RankPlan, ...]
    model_bytes: int  # every weight of the model
    model_download_bytes: int  # every file of the model
    support_files: tuple[str, ...]
    notes: tuple[str, ...] = ()
    suggested_split: tuple[int, ...] | None = None
    tp: int = 1  # ranks per tensor-parallel group (1: pipeline only)

    @property
    def fits(self) -> bool:
        return all(r.fits is not False for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["fits"] = self.fits
        for r, rp in zip(data["ranks"], self.ranks, strict=True):
            r["layers"] = rp.layers
        return data


# --- The plan ------------------------------------------------------------------------


def make_plan(
    meta: ModelMetadata,
    hosts: Sequence[Host],
    *,
    strategy: str | None = None,
    split: Sequence[int] | None = None,
    context: int = DEFAULT_CONTEXT,
    tp: int = 1,
    facts: ClusterFacts | None = None,
    workload: Workload = DEFAULT_WORKLOAD,
    backend: str = "ring",
) -> Plan:
    """Plan ``meta`` over ``hosts``, in groups of ``tp`` per stage (a size they divide into: ``cluster.target.Target``
    checks it as it is born).

    ``balanced`` weighs ``workload``'s two phases on each stage's hosts, as ``facts`` measured them
    (``plan/estimate.py``; without facts, like hosts)."""
    if context <= 0:
        raise UsageError(f"--context must be positive, got {context}")
    tensor.check_heads(meta.text_config, tp, meta.source)
    n = meta.num_layers
    costs = tensor.member_costs(model_costs(meta), tp, meta.text_config)
    stages = tensor.stage_hosts(hosts, tp)
    work = None
    if split is None and strategy in (None, "balanced"):
        work = phase_costs(Costing(model_work(meta), facts, backend), tp, len(stages), workload)
    strategy, chosen = choose_split(strategy, split, n, stages, work, tp=tp)
    groups = kv_sharing_groups(meta.text_config)
    chosen = _keep_groups(strategy, chosen, groups, n)
    max_positions = int(meta.text_config.get("max_position_embeddings") or 1 << 20)
    ranges = layer_ranges(chosen)
    ranks = [_rank_plan(meta, costs, host, (i // tp, i % tp), ranges[i // tp], context, max_positions)
             for i, host in enumerate(hosts)]
    plan = Plan(
        model=meta.source,
        commit=meta.commit,
        strategy=strategy,
        num_layers=n,
        context=context,
        split=tuple(chosen),
        ranks=tuple(ranks),
        model_bytes=sum(t.nbytes for t in meta.tensors if _runs_within(meta.layer_of(t), n)),
        model_download_bytes=sum(meta.file_sizes.values()),
        support_files=meta.support_files,
        notes=_notes(hosts) + tensor.notes(tp, len(stages), meta.text_config)
        + _strategy_notes(strategy, costs, meta, workload)
        + _group_notes(groups) + _vision_notes(costs),
        tp=tp,
    )
    if not plan.fits:
        suggestion = suggest_split(costs, stages, context)
        if suggestion is not None and groups:
            suggestion = legal_split(suggestion, groups)
        if suggestion is not None and tuple(suggestion) != plan.split:
            plan = _replace(plan, suggested_split=tuple(suggestion))
    return plan


def _rank_plan(meta: ModelMetadata, costs: Costs, host: Host, place: tuple[int, int], layers: tuple[int, int],
               context: int, max_positions: int) -> RankPlan:
    """One rank's share: its stage's layers, a member's part of them (``costs`` are per member)."""
    (stage, tp_index), (start, end) = place, layers
    n = meta.num_layers
    files = set(costs.shared_files).union(*costs.layer_files[start:end], costs.vision_files if start == 0 else ())
    weights = rank_weight_bytes(costs, start, end)
    kv = costs.kv[start:end]
    budget = budget_bytes(host)
    headroom = fits = max_ctx = None
    if budget is not None:
        free = budget - weights - RUNTIME_OVERHEAD
        headroom = free - kv_bytes(kv, context)
        fits = headroom >= 0
        max_ctx = max_context(kv, free, max_positions)
    # The pipeline's work per token: every stage's, each split among its ``tp`` members.
    total_work = (sum(costs.layer_work) + costs.head_work) * costs.members
    work = sum(costs.layer_work[start:end]) + (costs.head_work if end == n else 0)
    support_bytes = sum(meta.file_sizes.get(f, 0) for f in meta.support_files)
    return RankPlan(
        rank=host.rank,
        host=host.ssh,
        start=start,
        end=end,
        weight_bytes=weights,
        files=tuple(sorted(files)),
        download_bytes=sum(meta.file_sizes.get(f, 0) for f in files) + support_bytes,
        kv_bytes_per_1k=kv_bytes(kv, 1000),
        work_share=work / total_work if total_work else 0.0,
        budget_bytes=budget,
        headroom_bytes=headroom,
        fits=fits,
        max_context=max_ctx,
        stage=stage,
        tp_index=tp_index,
    )


def suggest_split(costs: Costs, hosts: Sequence[Host], context: int) -> list[int] | None:
    """A split under which every rank fits, or None if none exists.

    Tries the split proportional to each host's spare capacity first (balanced),
    then searches every split in pipeline order (finds one whenever one exists).
    """
    budgets = [budget_bytes(h) for h in hosts]
    if any(b is None for b in budgets):
        return None
    n, size = len(costs.layer_bytes), len(hosts)
    caps = [b - costs.shared_bytes - RUNTIME_OVERHEAD for b in budgets]  # type: ignore[operator]
    caps[-1] -= costs.vision_bytes  # the highest rank takes the first layers, and the vision tower with them
    if any(c <= 0 for c in caps):
        return None

    def fits(split: Sequence[int]) -> bool:
        return all(
            sum(costs.layer_bytes[s:e]) + kv_bytes(costs.kv[s:e], context) <= caps[r]
            for r, (s, e) in enumerate(layer_ranges(split))
        )

    balanced = proportional_split(n, caps)
    if fits(balanced):
        return balanced
    # A greedy fill can strand a small host behind a large one, so search all
    # boundaries: the highest rank takes the first layers; a layer's cost
    # (weights + KV at ``context``) is additive, so prefix sums price a range.
    cost = [costs.layer_bytes[i] + kv_bytes(costs.kv[i : i + 1], context) for i in range(n)]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # reach[k]: layer boundary -> where the previous rank's range started, for
    # the first k ranks in pipeline order (ranks size-1 ... size-k).
    reach: list[dict[int, int]] = [{0: 0}]
    for k in range(size):
        cap, nxt = caps[size - 1 - k], dict[int, int]()
        for start in reach[-1]:
            end = start + 1
            while end <= n - (size - 1 - k) and prefix[end] - prefix[start] <= cap:
                nxt.setdefault(end, start)
                end += 1
        if not nxt:
            return None
        reach.append(nxt)
    if n not in reach[-1]:
        return None
    split, end = [0] * size, n
    for k in range(size, 0, -1):
        start = reach[k][end]
        split[size - k] = end - start
        end = start
    return split


def _keep_groups(strategy: str, split: list[int], groups: Sequence[tuple[int, int]], n: int) -> list[int]:
    # (with --tp, ``split`` is per stage: a stage runs a group's layers on every member, as one rank would)
    """``split`` with no group of KV-sharing layers cut: a given --split is refused, a computed one moved."""
    if strategy == "split":
        check_groups(split, groups)
        return split
    if cut_group(split, groups) is None:
        return split
    legal = legal_split(split, groups)
    if legal is None:
        first, last = cut_group(split, groups)  # type: ignore[misc]
        raise PlanError(
            f"no split of {n} layers over {len(split)} hosts keeps layers {first}-{last} "
            "(which share KV caches) on one rank",
            "use fewer hosts",
        )
    return legal


def _group_notes(groups: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    return tuple(
        f"layers {first}-{last} share KV caches: they run on one rank" for first, last in groups
    )


def _notes(hosts: Sequence[Host]) -> tuple[str, ...]:
    if any(h.memory_gb and not h.wired_limit_gb for h in hosts):
        return (
            "Budgets assume macOS's default GPU wired limit (about 67% of RAM up to 36 GB, 75% above). "
            "If you raised it with `sudo sysctl iogpu.wired_limit_mb=N`, add wired_limit_gb to that host.",
        )
    return ()


def _vision_notes(costs: Costs) -> tuple[str, ...]:
    if not costs.vision_bytes:
        return ()
    return ("the vision tower and projector run on the first stage (the rank of layer 0): its weights and download "
            "count them, and no other rank holds them.",)


def _strategy_notes(strategy: str, costs: Costs, meta: ModelMetadata, workload: Workload) -> tuple[str, ...]:
    experts = " (routed experts: the share each token uses)" if active_experts(meta.text_config)[1] else ""
    if strategy != "balanced" or not (costs.head_work or experts):
        return ()
    layer = sum(costs.layer_work) / len(costs.layer_work)
    head = f"{costs.head_work / layer:.1f} layers" if layer else "nothing"
    if workload.concurrent:
        return (
            f"balanced, for {workload.describes}: every stage is busy at once, so each does about the same share of a "
            f"request, its layers on every prompt and generated token{experts}; rank 0 also runs the vocabulary "
            f"head, worth {head} in bytes, on every generated token.",
        )
    return (
        f"balanced, for {workload.describes}: a prompt goes at the pace of its busiest stage, so each stage gets "
        f"about the same work per prompt token{experts}; rank 0's vocabulary head, worth {head} in bytes, runs on "
        "every generated token but once per prompt.",
    )


def _replace(plan: Plan, **changes: Any) -> Plan:
    from dataclasses import replace

    return replace(plan, **changes)


def _runs_within(layer: int | None, n: int) -> bool:
    """Whether a tensor of ``layer`` (None: outside the blocks) is part of a model cut to its first ``n`` layers."""
    return layer is None or layer < n
