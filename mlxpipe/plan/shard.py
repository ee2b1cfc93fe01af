"""The shard plan: which layers each rank runs, what it must hold and fetch.

Pure functions over plain data (the model's metadata and the hostfile): no MLX,
no network, so planning is instant and exhaustively testable.

mlx-lm's convention holds throughout: rank 0 runs the LAST layers and the
highest rank the FIRST (``mlx_lm.models.pipeline.PipelineMixin.pipeline``), and
a split lists layers per rank in rank order.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from mlxpipe.errors import PlanError, UsageError
from mlxpipe.cluster.hostfile import GB, Host
from mlxpipe.model.metadata import ModelMetadata, kv_bytes_per_token, kv_sharing_groups

STRATEGIES = ("even", "memory", "balanced", "split")
DEFAULT_CONTEXT = 4096
# Activations, the runtime and the tokenizer: held back from every host's budget.
RUNTIME_OVERHEAD = GB // 2
# What macOS lets the GPU wire by default (iogpu.wired_limit_mb = 0): about
# two thirds of RAM up to 36 GB, three quarters above.
SMALL_MAC_GB = 36


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
    split: tuple[int, ...]  # layers per rank, rank order
    ranks: tuple[RankPlan, ...]
    model_bytes: int  # every weight of the model
    model_download_bytes: int  # every file of the model
    support_files: tuple[str, ...]
    notes: tuple[str, ...] = ()
    suggested_split: tuple[int, ...] | None = None

    @property
    def fits(self) -> bool:
        return all(r.fits is not False for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["fits"] = self.fits
        for r, rp in zip(data["ranks"], self.ranks):
            r["layers"] = rp.layers
        return data


# --- Splits ------------------------------------------------------------------------


def even_split(num_layers: int, size: int) -> list[int]:
    """mlx-lm's even split: the low ranks get the extra layers."""
    base, extra = divmod(num_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def proportional_split(num_layers: int, weights: Sequence[float]) -> list[int]:
    """Layers proportional to ``weights``, every rank at least one (largest remainder)."""
    size = len(weights)
    spare = num_layers - size
    total = sum(weights)
    shares = [spare * w / total for w in weights]
    split = [1 + int(s) for s in shares]
    order = sorted(range(size), key=lambda r: (-(shares[r] - int(shares[r])), r))
    for r in order[: num_layers - sum(split)]:
        split[r] += 1
    return split


def layer_ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    """Each rank's [start, end): rank r runs the layers after those of ranks > r."""
    return [(sum(split[r + 1 :]), sum(split[r:])) for r in range(len(split))]


def check_split(split: Sequence[int], num_layers: int, size: int) -> None:
    if len(split) != size:
        raise UsageError(
            f"--split has {len(split)} entries but the hostfile has {size} hosts",
            "give one layer count per host, in rank order",
        )
    if any(s <= 0 for s in split):
        raise UsageError(f"--split {_fmt(split)}: every rank needs at least one layer")
    if sum(split) != num_layers:
        raise UsageError(
            f"--split {_fmt(split)} sums to {sum(split)} but the model has {num_layers} layers",
            "the layer counts must add up to the model's layers",
        )


def cuts(split: Sequence[int]) -> list[int]:
    """The layer boundaries between ranks, in pipeline order (first layers first)."""
    return sorted(start for start, _ in layer_ranges(split)[:-1])


def cut_group(split: Sequence[int], groups: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The first group of layers ``split`` puts on two ranks, None when it keeps every one whole."""
    for first, last in groups:
        if any(first < c <= last for c in cuts(split)):
            return first, last
    return None


def legal_split(split: Sequence[int], groups: Sequence[tuple[int, int]]) -> list[int] | None:
    """``split`` with each cut inside a group moved to the nearest legal cut; None when none exists.

    The cuts move as little as they can in total (each stays where it is when legal).
    """
    n, size = sum(split), len(split)
    wanted = cuts(split)
    legal = [c for c in range(1, n) if not any(first < c <= last for first, last in groups)]
    if len(legal) < len(wanted):
        return None
    # best[j]: (total move, cuts) with the latest cut at legal[j], for the cuts placed so far.
    best: list[tuple[int, list[int]] | None] = [(abs(c - wanted[0]), [c]) for c in legal] if wanted else []
    for want in wanted[1:]:
        running: tuple[int, list[int]] | None = None
        nxt: list[tuple[int, list[int]] | None] = []
        for j, c in enumerate(legal):
            nxt.append(None if running is None else (running[0] + abs(c - want), running[1] + [c]))
            if best[j] is not None and (running is None or best[j][0] < running[0]):  # type: ignore[index]
                running = best[j]
        best = nxt
    if not wanted:
        return list(split)
    options = [b for b in best if b is not None]
    if not options:
        return None
    chosen = min(options, key=lambda b: b[0])[1]
    bounds = [0, *chosen, n]
    return [bounds[i + 1] - bounds[i] for i in range(size)][::-1]  # rank order


def check_groups(split: Sequence[int], groups: Sequence[tuple[int, int]]) -> None:
    """Raise PlanError, with a split that keeps them whole, when ``split`` cuts a group."""
    group = cut_group(split, groups)
    if group is None:
        return
    legal = legal_split(split, groups)
    hint = f"try --split {_fmt(legal)}" if legal else "use fewer hosts"
    raise PlanError(
        f"--split {_fmt(split)} cuts layers {group[0]}-{group[1]}, which share KV caches and must run on one rank",
        hint,
    )


def balanced_split(layer_work: Sequence[int], head_work: int, size: int) -> list[int]:
    """The split whose busiest stage has the least work per token (exact).

    A stage's work is the sum of its layers' ``layer_work``, plus ``head_work``
    on rank 0, which runs the last layers and the vocabulary head. Of the
    splits with the least maximum, the earlier stages (higher ranks) take as
    many layers as they can, so uniform layers without a head split evenly.
    """
    n = len(layer_work)
    prefix = [0]
    for w in layer_work:
        prefix.append(prefix[-1] + w)

    def work(start: int, end: int, stages_left: int) -> int:
        """Layers [start, end) as the stage with ``stages_left`` stages after it (0: rank 0)."""
        return prefix[end] - prefix[start] + (head_work if stages_left == 0 else 0)

    # least[k][s]: the least maximum work for layers [s, n) over the last k stages.
    inf = float("inf")
    least: list[list[float]] = [[inf] * (n + 1) for _ in range(size + 1)]
    least[0][n] = 0
    for k in range(1, size + 1):
        for s in range(n - k, -1, -1):
            least[k][s] = min(
                max(work(s, e, k - 1), least[k - 1][e]) for e in range(s + 1, n - (k - 1) + 1)
            )
    best = least[size][0]
    split_in_pipeline_order, s = [], 0
    for k in range(size, 0, -1):
        e = max(e for e in range(s + 1, n - (k - 1) + 1)
                if work(s, e, k - 1) <= best and least[k - 1][e] <= best)
        split_in_pipeline_order.append(e - s)
        s = e
    return split_in_pipeline_order[::-1]  # rank order: rank 0 runs the last stage


def choose_split(
    strategy: str | None,
    split: Sequence[int] | None,
    num_layers: int,
    hosts: Sequence[Host],
    work: tuple[list[int], int] | None = None,
) -> tuple[str, list[int]]:
    """Resolve the strategy (default: memory when every host declares it, else balanced).

    ``work`` (each layer's work per token, the head's) is what ``balanced`` weighs; without
    it the default is mlx-lm's even split.
    """
    size = len(hosts)
    if size > num_layers:
        raise PlanError(
            f"the hostfile has {size} hosts but the model has only {num_layers} layers",
            "use at most one host per layer",
        )
    if split is not None:
        if strategy not in (None, "split"):
            raise UsageError("--split and --strategy conflict", "give one of them")
        check_split(split, num_layers, size)
        return "split", list(split)
    if strategy is None:
        strategy = "memory" if all(h.memory_gb for h in hosts) else "balanced" if work is not None else "even"
    if strategy == "even":
        return strategy, even_split(num_layers, size)
    if strategy == "memory":
        missing = [h for h in hosts if not h.memory_gb]
        if missing:
            raise UsageError(
                f"--strategy memory needs 'memory_gb' for every host; {missing[0].label} has none",
                "add memory_gb to each host in the hostfile, or use --strategy even",
            )
        return strategy, proportional_split(num_layers, [budget_bytes(h) or 0 for h in hosts])
    if strategy == "balanced":
        if work is None:
            raise UsageError("--strategy balanced needs the model's tensors")
        return strategy, balanced_split(work[0], work[1], size)
    raise UsageError(f"unknown strategy {strategy!r}", f"use one of: {', '.join(STRATEGIES[:3])} or --split")


# --- Costs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    layer_bytes: list[int]
    shared_bytes: int
    layer_files: list[set[str]]
    shared_files: set[str]
    kv: list[tuple[int, int | None]]
    layer_work: list[int]  # bytes each layer reads per generated token
    head_work: int  # bytes the vocabulary head reads per token (rank 0's extra)


# The routed experts' weights (mlx-lm's stacked ``switch_mlp``, or per-expert tensors).
_EXPERT_RE = re.compile(r"\.(switch_mlp|experts)\.")
_HEAD_RE = re.compile(r"(^|\.)lm_head\.")
_EMBED_RE = re.compile(r"(^|\.)embed_tokens\.")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")
_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def _costs(meta: ModelMetadata) -> _Costs:
    n = meta.num_layers
    layer_bytes, layer_work = [0] * n, [0] * n
    layer_files: list[set[str]] = [set() for _ in range(n)]
    shared_bytes, shared_files = 0, set()
    head_bytes = embed_bytes = 0
    active, experts = _active_experts(meta.text_config)
    for t in meta.tensors:
        layer = meta.layer_of(t)
        if layer is None:
            shared_bytes += t.nbytes
            shared_files.add(t.file)
            if _HEAD_RE.search(t.name):
                head_bytes += t.nbytes
            elif _EMBED_RE.search(t.name):
                embed_bytes += t.nbytes
        elif layer < n:  # layers past num_hidden_layers (MTP) are dropped by sanitize
            layer_bytes[layer] += t.nbytes
            layer_files[layer].add(t.file)
            routed = experts and _EXPERT_RE.search(t.name)
            layer_work[layer] += t.nbytes * active // experts if routed else t.nbytes
    # Tied embeddings: the head is the embedding matrix itself.
    head_work = head_bytes or embed_bytes
    return _Costs(layer_bytes, shared_bytes, layer_files, shared_files, kv_bytes_per_token(meta),
                  layer_work, head_work)


def _active_experts(config: dict[str, Any]) -> tuple[int, int]:
    """(experts each token uses, routed experts per layer); (0, 0) for a dense model."""
    active = next((config[k] for k in _EXPERTS_PER_TOKEN_KEYS if isinstance(config.get(k), int)), 0)
    experts = next((config[k] for k in _EXPERTS_KEYS if isinstance(config.get(k), int)), 0)
    return (active, experts) if 0 < active <= experts else (0, 0)


def kv_bytes(kv: Sequence[tuple[int, int | None]], tokens: int) -> int:
    """KV-cache bytes for ``tokens`` of context over the given layers."""
    return sum(per * (min(tokens, w) if w else tokens) for per, w in kv)


def budget_bytes(host: Host) -> int | None:
    """What the GPU may use on ``host``: the wired limit, else macOS's default share."""
    if host.wired_limit_gb:
        return int(host.wired_limit_gb * GB)
    if not host.memory_gb:
        return None
    share = 0.67 if host.memory_gb <= SMALL_MAC_GB else 0.75
    return int(host.memory_gb * share * GB)


def _max_context(kv: Sequence[tuple[int, int | None]], free: int, limit: int) -> int:
    """The longest context whose KV cache fits in ``free`` bytes (binary search)."""
    if free < 0:
        return 0
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_bytes(kv, mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _rank_weight_bytes(costs: _Costs, start: int, end: int) -> int:
    return costs.shared_bytes + sum(costs.layer_bytes[start:end])


# --- The plan ------------------------------------------------------------------------


def make_plan(
    meta: ModelMetadata,
    hosts: Sequence[Host],
    *,
    strategy: str | None = None,
    split: Sequence[int] | None = None,
    context: int = DEFAULT_CONTEXT,
) -> Plan:
    """Plan ``meta`` over ``hosts``."""
    if context <= 0:
        raise UsageError(f"--context must be positive, got {context}")
    n = meta.num_layers
    costs = _costs(meta)
    strategy, chosen = choose_split(strategy, split, n, hosts, (costs.layer_work, costs.head_work))
    groups = kv_sharing_groups(meta.text_config)
    chosen = _keep_groups(strategy, chosen, groups, n)
    max_positions = int(meta.text_config.get("max_position_embeddings") or 1 << 20)
    support_bytes = sum(meta.file_sizes.get(f, 0) for f in meta.support_files)
    ranks = []
    total_work = sum(costs.layer_work) + costs.head_work
    for host, (start, end) in zip(hosts, layer_ranges(chosen)):
        files = set(costs.shared_files).union(*costs.layer_files[start:end])
        weights = _rank_weight_bytes(costs, start, end)
        kv = costs.kv[start:end]
        budget = budget_bytes(host)
        headroom = fits = max_ctx = None
        if budget is not None:
            free = budget - weights - RUNTIME_OVERHEAD
            headroom = free - kv_bytes(kv, context)
            fits = headroom >= 0
            max_ctx = _max_context(kv, free, max_positions)
        ranks.append(
            RankPlan(
                rank=host.rank,
                host=host.ssh,
                start=start,
                end=end,
                weight_bytes=weights,
                files=tuple(sorted(files)),
                download_bytes=sum(meta.file_sizes.get(f, 0) for f in files) + support_bytes,
                kv_bytes_per_1k=kv_bytes(kv, 1000),
                work_share=(sum(costs.layer_work[start:end]) + (costs.head_work if end == n else 0)) / total_work
                if total_work else 0.0,
                budget_bytes=budget,
                headroom_bytes=headroom,
                fits=fits,
                max_context=max_ctx,
            )
        )
    plan = Plan(
        model=meta.source,
        commit=meta.commit,
        strategy=strategy,
        num_layers=n,
        context=context,
        split=tuple(chosen),
        ranks=tuple(ranks),
        model_bytes=sum(t.nbytes for t in meta.tensors if meta.layer_of(t) is None or meta.layer_of(t) < n),
        model_download_bytes=sum(meta.file_sizes.values()),
        support_files=meta.support_files,
        notes=_notes(hosts) + _strategy_notes(strategy, costs, meta) + _group_notes(groups),
    )
    if not plan.fits:
        suggestion = suggest_split(costs, hosts, context)
        if suggestion is not None and groups:
            suggestion = legal_split(suggestion, groups)
        if suggestion is not None and tuple(suggestion) != plan.split:
            plan = _replace(plan, suggested_split=tuple(suggestion))
    return plan


def suggest_split(costs: _Costs, hosts: Sequence[Host], context: int) -> list[int] | None:
    """A split under which every rank fits, or None if none exists.

    Tries the split proportional to each host's spare capacity first (balanced),
    then searches every split in pipeline order (finds one whenever one exists).
    """
    budgets = [budget_bytes(h) for h in hosts]
    if any(b is None for b in budgets):
        return None
    n, size = len(costs.layer_bytes), len(hosts)
    caps = [b - costs.shared_bytes - RUNTIME_OVERHEAD for b in budgets]  # type: ignore[operator]
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
        cap, nxt = caps[size - 1 - k], {}
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


def _strategy_notes(strategy: str, costs: _Costs, meta: ModelMetadata) -> tuple[str, ...]:
    experts = " (routed experts: the share each token uses)" if _active_experts(meta.text_config)[1] else ""
    if strategy != "balanced" or not (costs.head_work or experts):
        return ()
    layer = sum(costs.layer_work) / len(costs.layer_work)
    head = f"{costs.head_work / layer:.1f} layers" if layer else "nothing"
    return (
        f"balanced: each stage reads about the same weight bytes per token{experts}; rank 0 also runs the "
        f"vocabulary head, worth {head}.",
    )


def _replace(plan: Plan, **changes: Any) -> Plan:
    from dataclasses import replace

    return replace(plan, **changes)


def _fmt(split: Sequence[int]) -> str:
    return ",".join(str(s) for s in split)
