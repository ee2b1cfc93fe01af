"""plan/shard.py, the planner: file selection and the fit check (splits: ``test_splits.py``, costs: ``test_costs.py``).

Metadata here is plain data (``ModelMetadata`` built from ``Tensor``s, ``fixtures/plan_inputs.py``): the
planner never reads files, so neither do these tests.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from fixtures.plan_inputs import MB, SLIDING, T, compositions, hosts, meta, uniform, wired
from mlxpipe.host import GB, Host
from mlxpipe.model.metadata import ModelMetadata, Tensor, kv_bytes_per_token
from mlxpipe.plan.costs import RUNTIME_OVERHEAD, kv_bytes
from mlxpipe.plan.shard import make_plan

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
        fitting = [s for s in compositions(n, size) if make_plan(m, cluster, split=s).fits]
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

