"""Splits: how many layers each rank runs, by strategy (even, memory, balanced) or as given.

Pure. mlx-lm's convention: a split lists layers per rank in rank order, and rank 0
runs the LAST layers. Groups of layers that share a KV cache must not be cut.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    tp: int = 1,
) -> tuple[str, list[int]]:
    """Resolve the strategy (default: memory when every host declares it, else balanced).

    ``work`` (each layer's work per token, the head's) is what ``balanced`` weighs; without
    it the default is mlx-lm's even split. With ``tp`` > 1, ``hosts`` holds one host per stage.
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
        return strategy, balanced_split(work[0], work[1], size)
    raise UsageError(f"unknown strategy {strategy!r}", f"use one of: {', '.join(STRATEGIES[:3])} or --split")


def split_text(split: Sequence[int]) -> str:
    """A split as ``--split`` takes it: ``15,15``."""
    return ",".join(str(s) for s in split)
