"""Splits: how many layers each rank runs, by strategy (even, memory, balanced) or as given.

Pure. mlx-lm's convention: a split lists layers per rank in rank order, and rank 0
runs the LAST layers. Groups of layers that share a KV cache must not be cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxpipe.errors import PlanError, UsageError
from mlxpipe.host import Host
from mlxpipe.plan.costs import budget_bytes

STRATEGIES = ("even", "memory", "balanced", "split")

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


def check_split(split: Sequence[int], num_layers: int, size: int, tp: int = 1) -> None:
    """Refuse a ``--split`` that does not give every rank (every stage with ``tp`` > 1) its layers."""
    if len(split) != size:
        if tp > 1:
            raise UsageError(
                f"--split has {len(split)} entries but --tp {tp} makes {size} stages of the hostfile's "
                f"{size * tp} hosts",
                "give one layer count per stage (group of --tp hosts), in rank order",
            )
        raise UsageError(
            f"--split has {len(split)} entries but the hostfile has {size} hosts",
            "give one layer count per host, in rank order",
        )
    if any(s <= 0 for s in split):
        raise UsageError(f"--split {split_text(split)}: every rank needs at least one layer")
    if sum(split) != num_layers:
        raise UsageError(
            f"--split {split_text(split)} sums to {sum(split)} but the model has {num_layers} layers",
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
    hint = f"try --split {split_text(legal)}" if legal else "use fewer hosts"
    raise PlanError(
        f"--split {split_text(split)} cuts layers {group[0]}-{group[1]}, "
        "which share KV caches and must run on one rank",
        hint,
    )


def balanced_split(layer_work: Sequence[float], head_work: float, size: int) -> list[int]:
    """The split whose busiest stage has the least work per token (exact).

    A stage's work is the sum of its layers' ``layer_work``, plus ``head_work``
    on rank 0, which runs the last layers and the vocabulary head. Of the
    splits with the least maximum, the earlier stages (higher ranks) take as
    many layers as they can, so uniform layers without a head split evenly.
    """
    prefix = _prefix(layer_work)
    return minimax_split(lambda k, s, e: prefix[e] - prefix[s] + (head_work if k == 0 else 0), len(layer_work), size)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def minimax_split(cost: Callable[[int, int, int], float], n: int, size: int) -> list[int]:
    """The split of ``n`` layers over ``size`` stages whose costliest stage costs least (exact); ``cost(k, s, e)``
    is stage ``k`` (0: the last layers) running layers [s, e). Ties: the earlier stages take all they can."""
    # least[k][s]: the least maximum for layers [s, n) over the last k stages (stages k-1 .. 0).
    inf = float("inf")
    least: list[list[float]] = [[inf] * (n + 1) for _ in range(size + 1)]
    least[0][n] = 0
    for k in range(1, size + 1):
        for s in range(n - k, -1, -1):
            least[k][s] = min(max(cost(k - 1, s, e), least[k - 1][e]) for e in range(s + 1, n - (k - 1) + 1))
    best = least[size][0] * (1 + _EPS)
    split_in_pipeline_order, s = [], 0
    for k in range(size, 0, -1):
        e = max(e for e in range(s + 1, n - (k - 1) + 1)
                if cost(k - 1, s, e) <= best and least[k - 1][e] <= best)
        split_in_pipeline_order.append(e - s)
        s = e
    return split_in_pipeline_order[::-1]  # rank order: rank 0 runs the last stage


_EPS = 1e-9  # float sums of the same costs in another order differ in their last bits


@dataclass(frozen=True)
class PhaseCosts:
    """What one token costs each layer in each phase, on each stage's hosts (``plan/estimate.py``: seconds).

    ``prefill[k][i]``: layer i on stage k per prompt token; ``decode[k][i]``: per generated token (per
    token of a decode group when ``concurrent``); the head runs on stage 0 only, once per prompt
    (``head_prefill``, per prompt token) and on every generated token (``head_decode``).
    """

    prefill: Sequence[Sequence[float]]
    decode: Sequence[Sequence[float]]
    head_prefill: float
    head_decode: float
    prompt: int  # tokens of a request's prompt
    generated: int  # tokens of its reply
    concurrent: bool  # many requests at once: every stage busy, the busiest one sets the pace

    def stage(self, k: int, start: int, end: int,
              prefix: tuple[list[list[float]], list[list[float]]]) -> tuple[float, float]:
        """Stage k on layers [start, end): (seconds per prompt token, seconds per generated token)."""
        pre, dec = prefix
        p = pre[k][end] - pre[k][start] + (self.head_prefill if k == 0 else 0.0)
        d = dec[k][end] - dec[k][start] + (self.head_decode if k == 0 else 0.0)
        return p, d


def phase_split(costs: PhaseCosts, size: int) -> list[int]:
    """The split under which a request takes least time, both phases counted (exact).

    One stream at a time (chat, agent): a prompt's chunks follow each other through the stages, so
    its prefill goes at the pace of the busiest stage, while each generated token crosses every
    stage in turn: least ``prompt * max(stage prefill) + generated * sum(stage decode)``. With uniform
    layers on like hosts the decode sum is the same for every split, and this is the split of the
    least busy prefill stage: the head, which runs once per prompt, barely counts. Many requests at
    once (batch): every stage is busy, and a request costs each stage its prompt's and its reply's
    share: least ``max(prompt * stage prefill + generated * stage decode)``, the head counted on every
    generated token.
    """
    n = len(costs.prefill[0])
    prefix = ([_prefix(row) for row in costs.prefill], [_prefix(row) for row in costs.decode])
    if costs.concurrent:
        def cost(k: int, s: int, e: int) -> float:
            p, d = costs.stage(k, s, e, prefix)
            return costs.prompt * p + costs.generated * d
        return minimax_split(cost, n, size)
    return _stream_split(costs, n, size, prefix)


def _stream_split(costs: PhaseCosts, n: int, size: int,
                  prefix: tuple[list[list[float]], list[list[float]]]) -> list[int]:
    """``phase_split`` for one stream: the Pareto fronts of (busiest prefill, decode sum) of every suffix."""
    # front[k][s]: for layers [s, n) over the last k stages, the points (max prefill, decode sum, the first of
    # those stages' end, the point of front[k-1][end] it continues) none of which another beats in both sums.
    Point = tuple[float, float, int, int]
    front: list[list[list[Point]]] = [[[] for _ in range(n + 1)] for _ in range(size + 1)]
    front[0][n] = [(0.0, 0.0, n, -1)]
    for k in range(1, size + 1):
        for s in range(n - k, -1, -1):
            points: list[Point] = []
            for e in range(n - (k - 1), s, -1):  # the longest first stage first: it wins ties
                p, d = costs.stage(k - 1, s, e, prefix)
                points += [(max(p, q[0]), d + q[1], e, j) for j, q in enumerate(front[k - 1][e])]
            front[k][s] = _pareto(points)
    options = front[size][0]
    least = min(costs.prompt * q[0] + costs.generated * q[1] for q in options)
    point = next(q for q in options if costs.prompt * q[0] + costs.generated * q[1] <= least * (1 + _EPS))
    split_in_pipeline_order, s = [], 0
    for k in range(size, 0, -1):
        _, _, e, j = point
        split_in_pipeline_order.append(e - s)
        s, point = e, front[k - 1][e][j] if k > 1 else point
    return split_in_pipeline_order[::-1]  # rank order: rank 0 runs the last stage


def _pareto(points: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The points no other beats in both sums (of equal ones the first: the longest first stage)."""
    kept: list[tuple[float, float, int, int]] = []
    for point in sorted(points, key=lambda q: (q[0], q[1])):  # stable: equal points keep their order
        if not kept or point[1] < kept[-1][1] * (1 - _EPS):
            kept.append(point)
    return kept


def choose_split(
    strategy: str | None,
    split: Sequence[int] | None,
    num_layers: int,
    hosts: Sequence[Host],
    work: PhaseCosts | None = None,
    tp: int = 1,
) -> tuple[str, list[int]]:
    """Resolve the strategy (default: memory when every host declares it, else balanced).

    ``work`` (what each layer costs in each phase, on each stage's hosts) is what ``balanced``
    weighs; without it the default is mlx-lm's even split. With ``tp`` > 1, ``hosts`` holds one
    host per stage.
    """
    size = len(hosts)
    if size > num_layers:
        if tp > 1:
            raise PlanError(
                f"--tp {tp} makes {size} stages but the model has only {num_layers} layers",
                f"use a larger --tp (at most {num_layers} stages)",
            )
        raise PlanError(
            f"the hostfile has {size} hosts but the model has only {num_layers} layers",
            "use at most one host per layer",
        )
    if split is not None:
        if strategy not in (None, "split"):
            raise UsageError("--split and --strategy conflict", "give one of them")
        check_split(split, num_layers, size, tp)
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
        return strategy, phase_split(work, size)
    raise UsageError(f"unknown strategy {strategy!r}", f"use one of: {', '.join(STRATEGIES[:3])} or --split")


def split_text(split: Sequence[int]) -> str:
    """A split as ``--split`` takes it: ``15,15``."""
    return ",".join(str(s) for s in split)
