"""plan/splits.py: the even, balanced and memory splits, their errors, and cuts kept out of KV-sharing groups."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from fixtures.plan_inputs import GEMMA3N, MB, T, compositions, hosts, meta, uniform
from mlxpipe.errors import PlanError, UsageError
from mlxpipe.host import Host
from mlxpipe.plan.parallel_layout import BATCH
from mlxpipe.plan.shard import make_plan
from mlxpipe.plan.splits import (
    PhaseCosts,
    balanced_split,
    choose_split,
    cut_group,
    even_split,
    layer_ranges,
    legal_split,
    phase_split,
    proportional_split,
)

# --- The even split is mlx-lm's own ----------------------------------------------------


class _Group:
    """What ``PipelineMixin.pipeline`` asks of an ``mx.distributed.Group``."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _mlx_lm_ranges(num_layers: int, size: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    from mlx_lm.models.pipeline import PipelineMixin

    class Stack(PipelineMixin):
        def __init__(self) -> None:
            super().__init__()
            self.layers = list(range(num_layers))

    ranges = []
    for rank in range(size):
        stack = Stack()
        stack.pipeline(_Group(rank, size), split)
        # The layers the rank keeps are exactly [start_idx, end_idx).
        assert [x for x in stack.layers if x is not None] == list(range(stack.start_idx, stack.end_idx))
        ranges.append((stack.start_idx, stack.end_idx))
    return ranges


def test_even_split_is_mlx_lm_pipeline_for_every_size() -> None:
    cluster = hosts(16)
    checked, mismatches = 0, []
    for num_layers in range(1, 129):
        for size in range(1, min(16, num_layers) + 1):
            _strategy, split = choose_split("even", None, num_layers, cluster[:size])
            ours = layer_ranges(split)
            if ours != _mlx_lm_ranges(num_layers, size):
                mismatches.append((num_layers, size))
            checked += 1
    assert mismatches == []
    assert checked == 1928


@pytest.mark.parametrize(("num_layers", "size"), [(61, 4), (80, 3), (7, 7), (128, 16), (30, 1)])
def test_even_plan_ranges_are_mlx_lm_pipeline(num_layers: int, size: int) -> None:
    plan = make_plan(uniform(num_layers, 1024), hosts(size), strategy="even")
    assert [(r.start, r.end) for r in plan.ranks] == _mlx_lm_ranges(num_layers, size)


@pytest.mark.parametrize("split", [[1, 5], [5, 1], [10, 12, 8], [1, 1, 1, 27], [3, 3]])
def test_explicit_split_is_mlx_lm_pipeline(split: list[int]) -> None:
    n = sum(split)
    plan = make_plan(uniform(n, 1024), hosts(len(split)), split=split)
    assert plan.strategy == "split"
    assert plan.split == tuple(split)
    assert [r.layers for r in plan.ranks] == split
    assert [(r.start, r.end) for r in plan.ranks] == _mlx_lm_ranges(n, len(split), split)


@pytest.mark.parametrize(
    ("num_layers", "size", "split", "ranges"),
    [
        (61, 4, [16, 15, 15, 15], [(45, 61), (30, 45), (15, 30), (0, 15)]),
        (10, 3, [4, 3, 3], [(6, 10), (3, 6), (0, 3)]),
        (5, 5, [1, 1, 1, 1, 1], [(4, 5), (3, 4), (2, 3), (1, 2), (0, 1)]),
    ],
)
def test_even_split_rank_zero_runs_the_last_layers(
    num_layers: int, size: int, split: list[int], ranges: list[tuple[int, int]]
) -> None:
    assert even_split(num_layers, size) == split
    assert layer_ranges(split) == ranges


# --- The balanced split: the same work per token on every stage ------------------------


def _stage_work(split: Sequence[int], layer_work: Sequence[int], head: int) -> list[int]:
    return [sum(layer_work[s:e]) + (head if r == 0 else 0) for r, (s, e) in enumerate(layer_ranges(split))]


def test_balanced_split_is_the_least_busiest_stage_of_all_splits() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 12)
        size = rng.randint(1, min(n, 4))
        layer_work = [rng.choice([1, 2, 3, 10, 50]) for _ in range(n)]
        head = rng.choice([0, 1, 5, 40])
        split = balanced_split(layer_work, head, size)
        assert sum(split) == n and len(split) == size and min(split) >= 1
        least = min(max(_stage_work(c, layer_work, head)) for c in compositions(n, size))
        assert max(_stage_work(split, layer_work, head)) == least, (layer_work, head, size, split)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_balanced_split_of_uniform_layers_without_a_head_is_even(size: int) -> None:
    for n in range(size, 65, size):
        assert balanced_split([5] * n, 0, size) == even_split(n, size)


@pytest.mark.parametrize("head", ["lm_head", "model.embed_tokens"], ids=["own-head", "tied-embedding"])
def test_balanced_plan_weighs_the_vocabulary_head_by_the_phase_it_runs_in(head: str) -> None:
    tensors = [T(f"model.layers.{i}.mlp.down_proj.weight", MB, "w.safetensors") for i in range(30)]
    tensors.append(T(f"{head}.weight", 3 * MB, "w.safetensors"))
    if head == "lm_head":  # an untied model also has its embedding, which costs no work per token
        tensors.append(T("model.embed_tokens.weight", 3 * MB, "w.safetensors"))
    # One chat at a time (the default): a prompt goes at the pace of its busiest stage, and the head runs once
    # per prompt, so it barely counts: the layers split evenly, as for prefill they should.
    plan = make_plan(meta(tensors, 30), hosts(2), strategy="balanced")
    assert (plan.strategy, plan.split) == ("balanced", (15, 15))
    assert plan.notes[-1] == (
        "balanced, for a chat turn (1,000-token prompt, 250 tokens out): a prompt goes at the pace of its busiest "
        "stage, so each stage gets about the same work per prompt token; rank 0's vocabulary head, worth 3.0 layers "
        "in bytes, runs on every generated token but once per prompt."
    )
    # Many requests at once: every stage is busy, and the head (3 layers' bytes, read on each of a request's 250
    # generated tokens) weighs against the layers' work on its 1,000 prompt tokens too: rank 0 takes one layer
    # fewer, where the decode-only balance of old took two (13, 17: see balanced_split below).
    batch = make_plan(meta(tensors, 30), hosts(2), strategy="balanced", workload=BATCH)
    assert batch.split == (14, 16)
    assert balanced_split([MB] * 30, 3 * MB, 2) == [13, 17]
    assert make_plan(meta(tensors, 30), hosts(2), strategy="even").split == (15, 15)


def test_balanced_plan_counts_routed_experts_at_the_share_each_token_uses() -> None:
    # Layers 0-1 dense (8 MiB), 2-7 MoE: 64 MiB of 16 routed experts of which each token uses 2 (8 MiB).
    tensors = [T(f"model.layers.{i}.mlp.down_proj.weight", 8 * MB, "w.safetensors") for i in range(2)]
    tensors += [T(f"model.layers.{i}.mlp.switch_mlp.down_proj.weight", 64 * MB, "w.safetensors") for i in range(2, 8)]
    moe = meta(tensors, 8, num_experts_per_tok=2, n_routed_experts=16)
    plan = make_plan(moe, hosts(2), strategy="balanced")
    assert plan.split == (4, 4)  # by bytes held it would be (3, 5): the dense layers look cheap
    assert "(routed experts: the share each token uses)" in plan.notes[-1]
    dense = meta(tensors, 8)  # without the expert counts every byte counts
    assert make_plan(dense, hosts(2), strategy="balanced").split == (3, 5)


# --- The memory strategy -------------------------------------------------------------------


def test_memory_split_is_proportional() -> None:
    cluster = [Host(rank=0, ssh="a", memory_gb=192), Host(rank=1, ssh="b", memory_gb=64)]
    # budgets 3:1; one layer each, then 59 spare layers as 44.25 / 14.75, the
    # leftover to the larger remainder.
    assert choose_split("memory", None, 61, cluster) == ("memory", [45, 16])


def test_memory_split_follows_the_gpu_budget_not_ram() -> None:
    # A wired limit raised to 480 of 512 GB counts, not the RAM.
    cluster = [
        Host(rank=0, ssh="a", memory_gb=512, wired_limit_gb=480),
        Host(rank=1, ssh="b", memory_gb=512),
        Host(rank=2, ssh="c", memory_gb=32),
    ]
    # budgets 480, 384, 21.44 GiB; 58 spare layers -> 31.44, 25.15, 1.40: the
    # leftover layer to the largest remainder (rank 0).
    assert choose_split("memory", None, 61, cluster) == ("memory", [33, 26, 2])


def test_memory_split_every_rank_gets_a_layer_and_its_share() -> None:
    rng = random.Random(7)
    for _ in range(400):
        size = rng.randint(1, 16)
        num_layers = rng.randint(size, 128)
        sizes = [8, 16, 24, 36, 48, 64, 96, 128, 192, 512]
        cluster = [Host(rank=r, ssh="h", memory_gb=rng.choice(sizes)) for r in range(size)]
        budgets = [h.memory_gb * (0.67 if h.memory_gb <= 36 else 0.75) for h in cluster]  # type: ignore[operator]
        _, split = choose_split("memory", None, num_layers, cluster)
        assert sum(split) == num_layers
        assert min(split) >= 1
        spare = num_layers - size
        for layers, budget in zip(split, budgets, strict=True):
            assert abs(layers - 1 - spare * budget / sum(budgets)) < 1


@pytest.mark.parametrize(
    ("cluster", "strategy", "split"),
    [
        # budgets 1:3, 10 spare layers -> 2.5, 7.5; the tie goes to the lower rank
        ([Host(rank=0, ssh="a", memory_gb=64), Host(rank=1, ssh="b", memory_gb=192)], "memory", [4, 8]),
        # Without every host's memory: the least work per token on the busiest stage, the head counted
        # (a head worth 2 layers here); without the model's tensors to weigh, mlx-lm's even split.
        ([Host(rank=0, ssh="a", memory_gb=64), Host(rank=1, ssh="b")], "balanced", [5, 7]),
        (hosts(3), "balanced", [2, 5, 5]),
    ],
)
def test_default_strategy(cluster: list[Host], strategy: str, split: list[int]) -> None:
    work = _decode_only([1] * 12, 2, len(cluster))
    assert choose_split(None, None, 12, cluster, work) == (strategy, split)
    if strategy == "balanced":
        assert choose_split(None, None, 12, cluster) == ("even", even_split(12, len(cluster)))


def _decode_only(layer_work: list[float], head: float, stages: int) -> PhaseCosts:
    """Phase costs that weigh only generated tokens, many at once: the balance of each layer's work per token."""
    return PhaseCosts(prefill=[[0.0] * len(layer_work)] * stages, decode=[list(layer_work)] * stages,
                      head_prefill=0.0, head_decode=head, prompt=0, generated=1, concurrent=True)


@pytest.mark.parametrize(
    ("weights", "split"),
    [([1, 1], [5, 5]), ([3, 1], [7, 3]), ([1000, 1], [9, 1]), ([1, 1, 1], [4, 3, 3]), ([0.5, 0.25, 0.25], [4, 3, 3])],
)
def test_proportional_split(weights: list[float], split: list[int]) -> None:
    assert proportional_split(10, weights) == split


# --- Split errors --------------------------------------------------------------------------

SPLIT_ERRORS = [
    ("too-many-ranks", dict(num_layers=4, size=5), PlanError,
     "the hostfile has 5 hosts but the model has only 4 layers", "use at most one host per layer"),
    ("split-short", dict(split=[4, 4]), UsageError,
     "--split has 2 entries but the hostfile has 3 hosts", "give one layer count per host, in rank order"),
    ("split-long", dict(split=[3, 3, 3, 3]), UsageError,
     "--split has 4 entries but the hostfile has 3 hosts", "give one layer count per host, in rank order"),
    ("split-sum-low", dict(split=[4, 4, 3]), UsageError,
     "--split 4,4,3 sums to 11 but the model has 12 layers", "the layer counts must add up to the model's layers"),
    ("split-sum-high", dict(split=[5, 5, 5]), UsageError,
     "--split 5,5,5 sums to 15 but the model has 12 layers", "the layer counts must add up to the model's layers"),
    ("split-zero", dict(split=[0, 6, 6]), UsageError, "--split 0,6,6: every rank needs at least one layer", None),
    ("split-negative", dict(split=[-1, 7, 6]), UsageError, "--split -1,7,6: every rank needs at least one layer", None),
    ("split-and-strategy", dict(split=[4, 4, 4], strategy="even"), UsageError,
     "--split and --strategy conflict", "give one of them"),
    ("memory-without-memory", dict(strategy="memory"), UsageError,
     "--strategy memory needs 'memory_gb' for every host; rank 0 (h0) has none",
     "add memory_gb to each host in the hostfile, or use --strategy even"),
    ("unknown-strategy", dict(strategy="fastest"), UsageError,
     "unknown strategy 'fastest'", "use one of: even, memory, balanced or --split"),
    ("context-zero", dict(context=0), UsageError, "--context must be positive, got 0", None),
]


@pytest.mark.parametrize(
    ("args", "error", "message", "hint"), [c[1:] for c in SPLIT_ERRORS], ids=[c[0] for c in SPLIT_ERRORS]
)
def test_split_errors(args: dict[str, Any], error: type[Exception], message: str, hint: str | None) -> None:
    num_layers, size = args.pop("num_layers", 12), args.pop("size", 3)
    with pytest.raises(error) as e:
        make_plan(uniform(num_layers, 1024), hosts(size), **args)
    assert (type(e.value), str(e.value), e.value.hint) == (error, message, hint)  # type: ignore[attr-defined]


def test_memory_strategy_names_the_host_without_memory() -> None:
    cluster = [Host(rank=0, ssh="a", memory_gb=64), Host(rank=1, ssh="studio-2", ips=("10.0.0.2",))]
    with pytest.raises(UsageError) as e:
        choose_split("memory", None, 12, cluster)
    assert str(e.value) == "--strategy memory needs 'memory_gb' for every host; rank 1 (studio-2) has none"


# --- Layers that share KV caches stay on one rank ----------------------------------------


@pytest.mark.parametrize(
    ("split", "legal"),
    [
        ([10, 10, 10], [12, 8, 10]),  # the cut at 20 moves to 18, the nearest legal one
        ([12, 9, 9], [12, 9, 9]),  # already legal: unchanged
        ([1, 29], [12, 18]),
        ([6, 6, 6, 6, 6], [12, 1, 5, 6, 6]),  # cuts 18 and 24 both fall in the group: 17 and 18 move least
        ([1] * 30, None),  # 29 cuts, only 18 legal places
    ],
)
def test_legal_split_moves_each_cut_out_of_the_group(split: list[int], legal: list[int] | None) -> None:
    assert legal_split(split, [(18, 29)]) == legal
    if legal is not None:
        assert cut_group(legal, [(18, 29)]) is None


def test_computed_splits_keep_the_group_on_one_rank() -> None:
    plan = make_plan(uniform(30, MB, **GEMMA3N), hosts(3), strategy="even")
    assert plan.split == (12, 8, 10)
    assert plan.ranks[0].start == 18
    assert "layers 18-29 share KV caches: they run on one rank" in plan.notes


def test_a_split_that_cuts_the_group_is_refused_with_a_legal_one() -> None:
    with pytest.raises(PlanError) as error:
        make_plan(uniform(30, MB, **GEMMA3N), hosts(3), split=[10, 10, 10])
    assert str(error.value.message) == (
        "--split 10,10,10 cuts layers 18-29, which share KV caches and must run on one rank"
    )
    assert error.value.hint == "try --split 12,8,10"


def test_no_split_keeps_the_group_whole() -> None:
    config = {"layer_types": ["sliding_attention"] * 4, "num_kv_shared_layers": 3}
    with pytest.raises(
        PlanError, match=r"no split of 4 layers over 2 hosts keeps layers 0-3 \(which share KV caches\) on one rank"
    ):
        make_plan(uniform(4, MB, **config), hosts(2), strategy="even")


# --- The two-phase split: a request's prompt and its reply, both counted ---------------------------------


def _phase_time(costs: PhaseCosts, split: Sequence[int]) -> float:
    """What ``phase_split`` minimizes, computed the long way for ``split`` (rank order)."""
    stages = []
    for k, (s, e) in enumerate(layer_ranges(split)):
        p = sum(costs.prefill[k][s:e]) + (costs.head_prefill if k == 0 else 0.0)
        d = sum(costs.decode[k][s:e]) + (costs.head_decode if k == 0 else 0.0)
        stages.append((p, d))
    if costs.concurrent:
        return max(costs.prompt * p + costs.generated * d for p, d in stages)
    return costs.prompt * max(p for p, _ in stages) + costs.generated * sum(d for _, d in stages)


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-stream", "many-at-once"])
def test_phase_split_is_the_least_time_of_all_splits(concurrent: bool) -> None:
    rng = random.Random(31)
    for _ in range(250):
        n = rng.randint(1, 10)
        size = rng.randint(1, min(n, 4))
        # Each stage's hosts differ (their own costs per layer), as hosts of other chips do.
        prefill = [[rng.choice([0.5, 1, 2, 7]) for _ in range(n)] for _ in range(size)]
        decode = [[rng.choice([1, 3, 4, 20]) for _ in range(n)] for _ in range(size)]
        costs = PhaseCosts(prefill, decode, head_prefill=rng.choice([0, 0.01]), head_decode=rng.choice([0, 5, 40]),
                           prompt=rng.choice([10, 1000]), generated=rng.choice([1, 250]), concurrent=concurrent)
        split = phase_split(costs, size)
        assert sum(split) == n and len(split) == size and min(split) >= 1
        least = min(_phase_time(costs, c) for c in compositions(n, size))
        assert _phase_time(costs, split) == pytest.approx(least), (costs, split)


def test_one_stream_on_like_hosts_splits_by_prefill_alone_whatever_the_head() -> None:
    # The model: 12 like layers and a head worth 35 of them in bytes. One chat at a time: a prompt goes at
    # its busiest stage's pace and every generated token crosses every stage anyway, so the even split is best.
    costs = PhaseCosts([[1.0] * 12] * 2, [[1.0] * 12] * 2, head_prefill=35 / 1000, head_decode=35.0, prompt=1000,
                       generated=250, concurrent=False)
    assert phase_split(costs, 2) == [6, 6]
    # Many at once: every stage is busy, and rank 0's share of each request includes the head on every token.
    assert phase_split(replace(costs, concurrent=True), 2) == [2, 10]  # 1,250 x 2 + 8,785 vs 1,250 x 10
    assert balanced_split([1] * 12, 35, 2) == [1, 11]  # the decode-only balance the issue measured


def test_one_stream_moves_layers_to_the_host_that_decodes_them_faster() -> None:
    # Host 1 (rank 1, the first layers) reads weights twice as fast: fewer seconds of decode per layer there.
    costs = PhaseCosts([[1.0] * 8, [1.0] * 8], [[2.0] * 8, [1.0] * 8], 0.0, 0.0, prompt=1, generated=100,
                       concurrent=False)
    assert phase_split(costs, 2) == [1, 7]
