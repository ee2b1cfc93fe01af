"""The planner: splits (checked against mlx-lm itself), file selection, costs and the fit check.

Metadata here is plain data (``ModelMetadata`` built from ``Tensor``s): the
planner never reads files, so neither do these tests.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any, Sequence

import pytest

from mlxpipe.errors import PlanError, UsageError
from mlxpipe.host import GB, Host
from mlxpipe.model.metadata import ModelMetadata, Tensor, kv_bytes_per_token
from mlxpipe.model.facts import kv_sharing_groups
from mlxpipe.plan.costs import RUNTIME_OVERHEAD, kv_bytes
from mlxpipe.plan.splits import (
    balanced_split,
    choose_split,
    cut_group,
    even_split,
    layer_ranges,
    legal_split,
    proportional_split,
)
from mlxpipe.plan.shard import make_plan

MB = 1024**2
SUPPORT = {"config.json": 7, "tokenizer.json": 11}


def hosts(n: int, **keys: Any) -> list[Host]:
    return [Host(rank=r, ssh=f"h{r}", **keys) for r in range(n)]


def wired(*limits: float) -> list[Host]:
    """Hosts whose GPU budget is exactly ``limits`` GiB."""
    return [Host(rank=r, ssh=f"h{r}", memory_gb=1024, wired_limit_gb=w) for r, w in enumerate(limits)]


def meta(
    tensors: Sequence[Tensor],
    num_layers: int,
    file_sizes: dict[str, int] | None = None,
    **config: Any,
) -> ModelMetadata:
    """A llama-like model described by ``tensors`` (bf16, 2 KV heads of 16 unless overridden)."""
    cfg = {
        "model_type": "llama", "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "bfloat16", **config,
    }
    if file_sizes is None:
        file_sizes = {}
        for t in tensors:
            file_sizes[t.file] = file_sizes.get(t.file, 0) + t.nbytes
    return ModelMetadata(
        source="test/model", config=cfg, tensors=tuple(tensors), file_sizes={**file_sizes, **SUPPORT},
        commit="c" * 40, support_files=tuple(sorted(SUPPORT)),
    )


def T(name: str, nbytes: int, file: str, dtype: str = "BF16") -> Tensor:
    """A tensor of exactly ``nbytes`` (a multiple of the dtype's width)."""
    width = {"BF16": 2, "F32": 4, "U32": 4, "U8": 1}[dtype]
    return Tensor(name, dtype, (nbytes // width,), file)


def uniform(num_layers: int, layer_bytes: int, shared_bytes: int = 0, **config: Any) -> ModelMetadata:
    tensors = [T(f"model.layers.{i}.mlp.down_proj.weight", layer_bytes, "w.safetensors") for i in range(num_layers)]
    if shared_bytes:
        tensors.append(T("model.embed_tokens.weight", shared_bytes, "w.safetensors"))
    return meta(tensors, num_layers, **config)


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
            strategy, split = choose_split("even", None, num_layers, cluster[:size])
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
        least = min(max(_stage_work(c, layer_work, head)) for c in _compositions(n, size))
        assert max(_stage_work(split, layer_work, head)) == least, (layer_work, head, size, split)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_balanced_split_of_uniform_layers_without_a_head_is_even(size: int) -> None:
    for n in range(size, 65, size):
        assert balanced_split([5] * n, 0, size) == even_split(n, size)


@pytest.mark.parametrize("head", ["lm_head", "model.embed_tokens"], ids=["own-head", "tied-embedding"])
def test_balanced_plan_gives_rank_0_fewer_layers_for_the_vocabulary_head(head: str) -> None:
    tensors = [T(f"model.layers.{i}.mlp.down_proj.weight", MB, "w.safetensors") for i in range(30)]
    tensors.append(T(f"{head}.weight", 3 * MB, "w.safetensors"))
    if head == "lm_head":  # an untied model also has its embedding, which costs no work per token
        tensors.append(T("model.embed_tokens.weight", 3 * MB, "w.safetensors"))
    plan = make_plan(meta(tensors, 30), hosts(2), strategy="balanced")
    # Rank 0: 13 layers + the head (3 layers' worth) = 16, rank 1: 17; 14 + 3 and 16 tie at 17,
    # and of equal splits the first stage (rank 1) takes all it can.
    assert (plan.strategy, plan.split) == ("balanced", (13, 17))
    assert plan.notes[-1] == (
        "balanced: each stage reads about the same weight bytes per token; rank 0 also runs the vocabulary head, "
        "worth 3.0 layers."
    )
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
        for layers, budget in zip(split, budgets):
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
    work = ([1] * 12, 2)
    assert choose_split(None, None, 12, cluster, work) == (strategy, split)
    if strategy == "balanced":
        assert choose_split(None, None, 12, cluster) == ("even", even_split(12, len(cluster)))


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


# --- Which tensors and files each rank needs -----------------------------------------------


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        # One rule finds the block list wherever it lives; lists inside blocks
        # (experts) and next to them (sublayers) are not blocks.
        (
            ["model.layers.3.mlp.experts.7.gate_proj.weight", "model.layers.3.mlp.switch_mlp.gate_proj.scales",
             "model.layers.12.self_attn.q_proj.weight", "model.layers.61.embed_tokens.weight",
             "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.sublayers.3.weight"],
            [3, 3, 12, 61, None, None, None, None],
        ),
        (["layers.0.attention.wq.weight", "output.weight"], [0, None]),
        (
            ["language_model.model.layers.4.mlp.down_proj.biases", "language_model.model.layers.5.mlp.down_proj.biases",
             "vision_tower.blocks.0.w"],
            [4, 5, None],
        ),
        (["transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"], [0, None]),
        (["backbone.layers.1.mixer.A_log", "backbone.embeddings.weight"], [1, None]),
    ],
)
def test_tensor_layer(names: list[str], expected: list[int | None]) -> None:
    tensors = tuple(Tensor(name, "BF16", (1,), "f") for name in names)
    meta = ModelMetadata("m", {"model_type": "llama", "num_hidden_layers": 13}, tensors, {})
    assert [meta.layer_of(t) for t in tensors] == expected


def _ranks(plan: Any) -> list[tuple[int, int, tuple[str, ...], int, int]]:
    return [(r.start, r.end, r.files, r.weight_bytes, r.download_bytes) for r in plan.ranks]


F1, F2, F3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
SIZES = {F1: 1000, F2: 2000, F3: 4000, "README.md": 13}


def _layer(i: int, file: str) -> list[Tensor]:
    """Layer i: 1 KiB * (i + 1) of attention and 2 KiB of MLP, so every layer weighs differently."""
    return [
        T(f"model.layers.{i}.self_attn.q_proj.weight", 1024 * (i + 1), file),
        T(f"model.layers.{i}.mlp.down_proj.weight", 2048, file, "U32"),
        T(f"model.layers.{i}.input_layernorm.weight", 64, file),
    ]


def L(i: int) -> int:
    return 1024 * (i + 1) + 2048 + 64


def test_several_layers_per_file() -> None:
    tensors = [
        T("model.embed_tokens.weight", 8192, F1), *_layer(0, F1), *_layer(1, F1),
        *_layer(2, F2), *_layer(3, F2),
        *_layer(4, F3), *_layer(5, F3), T("model.norm.weight", 64, F3), T("lm_head.weight", 8192, F3),
    ]
    plan = make_plan(meta(tensors, 6, SIZES), hosts(3), strategy="even")
    shared = 8192 + 64 + 8192
    support = 7 + 11
    assert _ranks(plan) == [
        (4, 6, (F1, F3), shared + L(4) + L(5), 1000 + 4000 + support),
        (2, 4, (F1, F2, F3), shared + L(2) + L(3), 1000 + 2000 + 4000 + support),
        (0, 2, (F1, F3), shared + L(0) + L(1), 1000 + 4000 + support),
    ]
    assert plan.model_bytes == shared + sum(L(i) for i in range(6))
    assert plan.model_download_bytes == 7000 + 13 + support
    assert plan.support_files == ("config.json", "tokenizer.json")


def test_tied_embeddings_every_rank_holds_embeddings_and_norm() -> None:
    shared_file, last = "shared.safetensors", "model-00002-of-00002.safetensors"
    tensors = [
        T("model.embed_tokens.weight", 4096, shared_file), *_layer(0, F1), *_layer(1, F1), *_layer(2, last),
        *_layer(3, last), T("model.norm.weight", 64, last),
    ]
    sizes = {shared_file: 4100, F1: 900, last: 950}
    plan = make_plan(meta(tensors, 4, sizes, tie_word_embeddings=True), hosts(4), strategy="even")
    assert [(r.start, r.files) for r in plan.ranks] == [
        (3, (last, shared_file)), (2, (last, shared_file)), (1, (F1, last, shared_file)), (0, (F1, last, shared_file)),
    ]
    assert [r.weight_bytes for r in plan.ranks] == [4096 + 64 + L(i) for i in (3, 2, 1, 0)]
    assert [r.download_bytes for r in plan.ranks] == [4100 + 950 + 18, 4100 + 950 + 18, 5968, 5968]


def test_moe_expert_tensors_belong_to_their_layer() -> None:
    experts = [
        T(f"model.layers.3.mlp.experts.{e}.{p}_proj.{s}", 256, "experts-3.safetensors", "U32")
        for e in range(8) for p in ("gate", "up", "down") for s in ("weight", "scales", "biases")
    ]
    switch = [T(f"model.layers.2.mlp.switch_mlp.{p}_proj.weight", 4096, "switch-2.safetensors") for p in ("gate", "up")]
    tensors = [
        T("model.embed_tokens.weight", 512, F1), *_layer(0, F1), *_layer(1, F1), *_layer(2, F1), *_layer(3, F1),
        *experts, *switch, T("model.norm.weight", 64, F1),
    ]
    sizes = {F1: 100, "experts-3.safetensors": 10_000, "switch-2.safetensors": 20_000}
    plan = make_plan(meta(tensors, 4, sizes), hosts(2), strategy="even")
    assert _ranks(plan) == [
        (2, 4, ("experts-3.safetensors", F1, "switch-2.safetensors"),
         576 + L(2) + L(3) + 8 * 9 * 256 + 2 * 4096, 30_118),
        (0, 2, (F1,), 576 + L(0) + L(1), 118),
    ]


@pytest.mark.parametrize(
    ("split", "files"),
    [
        ([2, 2], [("s.safetensors", "a.safetensors", "b.safetensors"), ("s.safetensors", "a.safetensors")]),
        ([1, 3], [("s.safetensors", "b.safetensors"), ("s.safetensors", "a.safetensors", "b.safetensors")]),
        ([3, 1], [("s.safetensors", "a.safetensors", "b.safetensors"), ("s.safetensors", "a.safetensors")]),
    ],
)
def test_one_layer_spread_over_two_files(split: list[int], files: list[tuple[str, ...]]) -> None:
    a, b, s = "a.safetensors", "b.safetensors", "s.safetensors"
    tensors = [
        T("model.embed_tokens.weight", 512, s), T("model.norm.weight", 64, s),
        *_layer(0, a), *_layer(1, a),
        T("model.layers.2.self_attn.q_proj.weight", 1024, a), T("model.layers.2.mlp.down_proj.weight", 2048, b),
        *_layer(3, b),
    ]
    plan = make_plan(meta(tensors, 4, {a: 10, b: 20, s: 40}), hosts(2), split=split)
    assert [r.files for r in plan.ranks] == [tuple(sorted(f)) for f in files]
    layer = [L(0), L(1), 1024 + 2048, L(3)]
    assert [r.weight_bytes for r in plan.ranks] == [576 + sum(layer[r.start : r.end]) for r in plan.ranks]


def _mtp() -> list[Tensor]:
    return [
        T("model.layers.4.eh_proj.weight", 50_000, "mtp.safetensors"),
        T("model.layers.4.embed_tokens.weight", 80_000, "mtp.safetensors"),
        T("model.layers.4.mlp.experts.0.gate_proj.weight", 30_000, "mtp.safetensors"),
    ]


def test_mtp_layer_past_num_hidden_layers_is_not_needed() -> None:
    tensors = [T("model.embed_tokens.weight", 512, F1), *(t for i in range(4) for t in _layer(i, F1)),
               T("model.norm.weight", 64, F1), *_mtp()]
    m = meta(tensors, 4, {F1: 5000, "mtp.safetensors": 160_000})
    plan = make_plan(m, hosts(2))
    assert _ranks(plan) == [(2, 4, (F1,), 576 + L(2) + L(3), 5018), (0, 2, (F1,), 576 + L(0) + L(1), 5018)]
    assert plan.model_bytes == 576 + sum(L(i) for i in range(4))
    assert plan.model_download_bytes == 165_018


def test_mtp_tensors_in_a_needed_file_are_not_counted() -> None:
    # DeepSeek-V3 keeps layer 61 (MTP) in the last shard, next to the final norm.
    last = F2
    mtp = [Tensor(t.name, t.dtype, t.shape, last) for t in _mtp()]
    tensors = [T("model.embed_tokens.weight", 512, F1), *_layer(0, F1), *_layer(1, F1), *_layer(2, F1),
               *_layer(3, last), T("model.norm.weight", 64, last), *mtp]
    plan = make_plan(meta(tensors, 4, {F1: 5000, last: 170_000}), hosts(2))
    assert _ranks(plan) == [
        (2, 4, (F1, last), 576 + L(2) + L(3), 175_018),
        (0, 2, (F1, last), 576 + L(0) + L(1), 175_018),
    ]
    assert plan.model_bytes == 576 + sum(L(i) for i in range(4))


def test_files_of_a_single_file_checkpoint() -> None:
    tensors = [T("model.embed_tokens.weight", 512, "model.safetensors"),
               *(t for i in range(3) for t in _layer(i, "model.safetensors"))]
    plan = make_plan(meta(tensors, 3, {"model.safetensors": 9999}), hosts(3))
    assert [(r.files, r.download_bytes) for r in plan.ranks] == [(("model.safetensors",), 10017)] * 3


# --- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "norm_dtype", "per_token"),
    [
        # GQA: keys and values for each KV head.
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}, "BF16", 2 * 8 * 128 * 2),
        # head_dim from hidden_size / heads.
        ({"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": None, "hidden_size": 2048},
         "BF16", 2 * 4 * 128 * 2),
        # MHA: no num_key_value_heads.
        ({"num_attention_heads": 8, "num_key_value_heads": None, "head_dim": None, "hidden_size": 512},
         "BF16", 2 * 8 * 64 * 2),
        ({"torch_dtype": "float32"}, "BF16", 2 * 2 * 16 * 4),
        ({"torch_dtype": None, "dtype": "float16"}, "F32", 2 * 2 * 16 * 2),
        # Untyped (quantized) checkpoints compute in the dtype of their norms.
        ({"torch_dtype": None}, "F32", 2 * 2 * 16 * 4),
        # MLA: one latent plus the rope key per token, whatever the head counts.
        ({"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
         "BF16", (512 + 64) * 2),
    ],
    ids=["gqa", "head-dim-from-hidden", "mha", "float32", "dtype-key", "norm-dtype", "mla"],
)
def test_kv_bytes_per_token(config: dict[str, Any], norm_dtype: str, per_token: int) -> None:
    tensors = [T(f"model.layers.{i}.input_layernorm.weight", 64, "w", norm_dtype) for i in range(3)]
    m = meta(tensors, 3, **config)
    assert kv_bytes_per_token(m) == [(per_token, None)] * 3
    plan = make_plan(m, hosts(2), strategy="even")
    assert [r.kv_bytes_per_1k for r in plan.ranks] == [2 * per_token * 1000, per_token * 1000]


SLIDING = 2 * 2 * 16 * 2  # bytes per token per layer of the default test config


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3},
         [128, None, 128, None, 128, None]),
        ({"sliding_window": 512, "sliding_window_pattern": 3}, [512, 512, None, 512, 512, None]),
        ({"sliding_window": 64, "model_type": "gemma2"}, [64, None, 64, None, 64, None]),
        ({"sliding_window": 4096}, [None] * 6),  # no per-layer pattern: assume every layer grows
        ({"layer_types": ["sliding_attention"] * 6}, [None] * 6),  # no window size: unbounded
    ],
    ids=["layer-types", "pattern", "gemma2", "window-only", "types-only"],
)
def test_sliding_window_layers(config: dict[str, Any], windows: list[int | None]) -> None:
    m = uniform(6, 1024, **config)
    assert kv_bytes_per_token(m) == [(SLIDING, w) for w in windows]


def test_sliding_window_layers_stop_growing() -> None:
    m = uniform(6, 1024, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 3)
    plan = make_plan(m, hosts(2), split=[2, 4])
    # rank 0: layers 4 (sliding) and 5 (full); rank 1: 0-3, two of each
    assert [r.kv_bytes_per_1k for r in plan.ranks] == [SLIDING * (128 + 1000), SLIDING * 2 * (128 + 1000)]
    kv = kv_bytes_per_token(m)
    assert [kv_bytes(kv, t) for t in (0, 1, 128, 129, 10_000)] == [
        0, 6 * SLIDING, 6 * 128 * SLIDING, SLIDING * 3 * (128 + 129), SLIDING * 3 * (128 + 10_000),
    ]


def test_nested_text_config() -> None:
    text = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6}
    m = ModelMetadata(
        source="vlm", config={"model_type": "gemma3", "text_config": text, "torch_dtype": "bfloat16"},
        tensors=tuple(T(f"language_model.model.layers.{i}.mlp.down_proj.weight", 1024, "w") for i in range(6)),
        file_sizes={"w": 6144},
    )
    assert (m.model_type, m.num_layers) == ("gemma3", 6)  # mlx-lm loads it by the top-level type
    assert kv_bytes_per_token(m) == [(2 * 4 * 256 * 2, 1024)] * 5 + [(2 * 4 * 256 * 2, None)]


# --- Fit check -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "budget"),
    [
        (Host(rank=0, ssh="a", memory_gb=16), int(16 * 0.67 * GB)),
        (Host(rank=0, ssh="a", memory_gb=36), int(36 * 0.67 * GB)),
        (Host(rank=0, ssh="a", memory_gb=64), int(64 * 0.75 * GB)),
        (Host(rank=0, ssh="a", memory_gb=512, wired_limit_gb=480), 480 * GB),
        (Host(rank=0, ssh="a", wired_limit_gb=20.5), int(20.5 * GB)),
        (Host(rank=0, ssh="a"), None),
    ],
)
def test_budget(host: Host, budget: int | None) -> None:
    plan = make_plan(uniform(2, GB, GB // 4), [host, Host(rank=1, ssh="b")], strategy="even")
    assert plan.ranks[0].budget_bytes == budget


def test_fits_and_headroom() -> None:
    # 8 layers of 1 GiB, 0.25 GiB shared; KV 128 B per token per layer.
    m = uniform(8, GB, GB // 4)
    plan = make_plan(m, wired(6, 5), strategy="even", context=8192)
    kv4 = 4 * 8192 * SLIDING
    assert [(r.weight_bytes, r.budget_bytes, r.headroom_bytes, r.fits) for r in plan.ranks] == [
        (GB // 4 + 4 * GB, 6 * GB, 6 * GB - GB // 4 - 4 * GB - RUNTIME_OVERHEAD - kv4, True),
        (GB // 4 + 4 * GB, 5 * GB, 5 * GB - GB // 4 - 4 * GB - RUNTIME_OVERHEAD - kv4, True),
    ]
    assert plan.fits is True
    assert plan.suggested_split is None


def test_does_not_fit_and_suggests_a_split() -> None:
    m = uniform(8, GB, GB // 4)
    plan = make_plan(m, wired(8, 3), strategy="even")
    assert [r.fits for r in plan.ranks] == [True, False]
    assert plan.ranks[1].headroom_bytes == 3 * GB - GB // 4 - 4 * GB - RUNTIME_OVERHEAD - 4 * 4096 * SLIDING
    assert plan.fits is False
    assert plan.suggested_split == (6, 2)
    assert make_plan(m, wired(8, 3), split=plan.suggested_split).fits is True


def test_no_split_fits() -> None:
    plan = make_plan(uniform(8, GB, GB // 4), wired(3, 3), strategy="even")
    assert (plan.fits, plan.suggested_split) == (False, None)


def test_shared_tensors_alone_do_not_fit() -> None:
    # The embeddings every rank holds exceed one host's budget: no split helps.
    plan = make_plan(uniform(8, GB // 8, 4 * GB), wired(20, 4))
    assert [r.fits for r in plan.ranks] == [True, False]
    assert plan.suggested_split is None


def test_hosts_without_memory_are_not_checked() -> None:
    plan = make_plan(uniform(4, GB), hosts(2))
    unchecked = [(r.budget_bytes, r.headroom_bytes, r.fits, r.max_context) for r in plan.ranks]
    assert unchecked == [(None, None, None, None)] * 2
    assert (plan.fits, plan.suggested_split, plan.notes) == (True, None, ())


def test_wired_limit_is_honoured() -> None:
    m = uniform(8, GB, GB // 4)
    # 64 GB of RAM gives a default budget of 48 GiB; the raised wired limit of 60 counts instead.
    default = make_plan(m, [Host(rank=0, ssh="a", memory_gb=64)] * 1)
    raised = make_plan(m, [Host(rank=0, ssh="a", memory_gb=64, wired_limit_gb=60)])
    assert (default.ranks[0].budget_bytes, raised.ranks[0].budget_bytes) == (48 * GB, 60 * GB)
    assert raised.ranks[0].headroom_bytes - default.ranks[0].headroom_bytes == 12 * GB
    # The note about macOS's default limit appears only while some host relies on it.
    assert len(default.notes) == 1 and "iogpu.wired_limit_mb" in default.notes[0]
    assert raised.notes == ()


def test_wired_limit_can_make_a_rank_fit() -> None:
    m = uniform(8, GB, GB // 4)
    small = [Host(rank=0, ssh="a", memory_gb=6), Host(rank=1, ssh="b", memory_gb=6)]
    assert make_plan(m, small).fits is False
    raised = [Host(rank=r, ssh=h, memory_gb=6, wired_limit_gb=5.5) for r, h in enumerate("ab")]
    assert make_plan(m, raised).fits is True


def test_max_context_is_monotone_in_memory_and_exact() -> None:
    m = uniform(8, GB, GB // 4, max_position_embeddings=1 << 40)
    kv = kv_bytes_per_token(m)
    previous = -1
    for limit in [4.5, 4.75, 4.8, 5, 5.5, 6, 8, 16, 64]:
        rank = make_plan(m, wired(limit, limit)).ranks[0]
        free = rank.budget_bytes - rank.weight_bytes - RUNTIME_OVERHEAD  # type: ignore[operator]
        assert rank.max_context >= previous  # type: ignore[operator]
        if free < 0:
            assert rank.max_context == 0
        else:
            longest: int = rank.max_context  # type: ignore[assignment]
            assert kv_bytes(kv[4:], longest) <= free < kv_bytes(kv[4:], longest + 1)
        previous = rank.max_context  # type: ignore[assignment]
    assert previous > 0


def test_max_context_is_capped_by_the_model() -> None:
    m = uniform(4, GB, max_position_embeddings=32768)
    assert [r.max_context for r in make_plan(m, wired(64, 64)).ranks] == [32768, 32768]


def test_max_context_with_only_sliding_layers_is_the_model_limit() -> None:
    m = uniform(4, GB, sliding_window=256, layer_types=["sliding_attention"] * 4, max_position_embeddings=8192)
    assert [r.max_context for r in make_plan(m, wired(3, 3)).ranks] == [8192, 8192]


def test_context_changes_the_fit() -> None:
    m = uniform(2, GB, max_position_embeddings=1 << 30)
    plan = make_plan(m, wired(2, 2), context=1000)
    assert plan.fits is True
    too_long = plan.ranks[0].max_context + 1  # type: ignore[operator]
    assert make_plan(m, wired(2, 2), context=too_long).fits is False


def _compositions(n: int, size: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, n), size - 1):
        bounds = (0, *cuts, n)
        out.append(tuple(bounds[i + 1] - bounds[i] for i in range(size)))
    return out


def test_suggested_split_exists_exactly_when_some_split_fits() -> None:
    """Exhaustive over small clusters: uneven layers and hosts, a small host between big ones."""
    rng = random.Random(1)
    unit = 64 * MB
    found = 0
    for _ in range(300):
        n = rng.randint(2, 7)
        size = rng.randint(2, min(n, 4))
        tensors = [T(f"model.layers.{i}.mlp.down_proj.weight", unit * rng.randint(1, 6), "w") for i in range(n)]
        m = meta(tensors, n)
        caps = [unit * rng.randint(1, 12) for _ in range(size)]
        cluster = wired(*((RUNTIME_OVERHEAD + c + 4096 * SLIDING * n) / GB for c in caps))
        plan = make_plan(m, cluster, strategy="even")
        fitting = [s for s in _compositions(n, size) if make_plan(m, cluster, split=s).fits]
        if plan.fits:
            assert plan.suggested_split is None
        elif fitting:
            found += 1
            assert plan.suggested_split in fitting, (n, caps, [t.nbytes for t in tensors])
        else:
            assert plan.suggested_split is None
    assert found > 20  # the generator does reach the interesting case


def test_plan_json_round_trips() -> None:
    plan = make_plan(uniform(4, GB), wired(8, 1), strategy="even")
    data = json.loads(json.dumps(plan.to_json()))
    assert data["fits"] is False
    assert data["split"] == [2, 2]
    assert data["suggested_split"] is None
    assert [(r["rank"], r["host"], r["start"], r["end"], r["layers"], r["fits"]) for r in data["ranks"]] == [
        (0, "h0", 2, 4, 2, True), (1, "h1", 0, 2, 2, False),
    ]


# --- Layers that share KV caches stay on one rank ----------------------------------------

# Gemma 3n E2B's pattern: four sliding layers then a full one; the last 10 of 30 read the
# caches of the last sliding (18) and full (19) layers before them.
GEMMA3N = {
    "num_kv_shared_layers": 10,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6,
}


@pytest.mark.parametrize(
    ("config", "groups"),
    [
        (GEMMA3N, [(18, 29)]),
        ({"num_kv_shared_layers": 0, "layer_types": GEMMA3N["layer_types"]}, []),
        ({"num_hidden_layers": 30}, []),
        # No layer types: Gemma's pattern (every sliding_window_pattern-th layer is full).
        ({"num_hidden_layers": 10, "num_kv_shared_layers": 4, "sliding_window_pattern": 5}, [(4, 9)]),
        ({"layer_types": ["full_attention"] * 4, "num_kv_shared_layers": 4}, [(0, 3)]),
        # AFM: the KV-reuse layers, run last, read the cache of the layer before them.
        ({"num_layers": 56, "num_kv_reuse_layers": 21}, [(34, 55)]),
    ],
)
def test_kv_sharing_groups(config: dict[str, Any], groups: list[tuple[int, int]]) -> None:
    assert kv_sharing_groups(config) == groups


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
    assert str(error.value.message) == "--split 10,10,10 cuts layers 18-29, which share KV caches and must run on one rank"
    assert error.value.hint == "try --split 12,8,10"


def test_no_split_keeps_the_group_whole() -> None:
    config = {"layer_types": ["sliding_attention"] * 4, "num_kv_shared_layers": 3}
    with pytest.raises(PlanError, match=r"no split of 4 layers over 2 hosts keeps layers 0-3 \(which share KV caches\) on one rank"):
        make_plan(uniform(4, MB, **config), hosts(2), strategy="even")
