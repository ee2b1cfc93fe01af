"""``--tp``: the planner's groups and per-member memory (pure), the refusals, the CLI, the doctor's link check.

Pure metadata and Typer's runner: no rank starts here (the ranks' side is tested with the worker).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fixtures.cli import REPO, invoke
from fixtures.plan_inputs import T, hosts, meta, wired
from mlxpipe.errors import PlanError, UsageError
from mlxpipe.model.metadata import Tensor
from mlxpipe.plan.costs import RUNTIME_OVERHEAD
from mlxpipe.plan.shard import make_plan
from mlxpipe.plan.splits import even_split, proportional_split

KB = 1024
N = 8  # layers
# One llama block: what a group splits (2-D projections) and what each member keeps whole (norms, biases).
SHARDED = {"self_attn.q_proj.weight": 64 * KB, "self_attn.k_proj.weight": 16 * KB, "self_attn.v_proj.weight": 16 * KB,
           "self_attn.o_proj.weight": 64 * KB, "mlp.gate_proj.weight": 128 * KB, "mlp.up_proj.weight": 128 * KB,
           "mlp.down_proj.weight": 128 * KB}
REPLICATED = {"input_layernorm.weight": 256, "post_attention_layernorm.weight": 256, "self_attn.o_proj.bias": 256}
VOCAB = {"model.embed_tokens.weight": 512 * KB, "lm_head.weight": 512 * KB}
FINAL_NORM = 256


def tensor(name: str, nbytes: int, file: str) -> Any:
    # 2-D unless the name says it is a 1-D tensor (norms, biases), as in a real checkpoint.
    t = T(name, nbytes, file)
    return t if name.endswith(("norm.weight", "bias")) else type(t)(t.name, t.dtype, (64, nbytes // 2 // 64), file)


def llama(heads: int = 8, kv_heads: int = 4, **config: Any) -> Any:
    """A llama of N layers, one file per layer, shared tensors in their own file."""
    ts = [tensor(f"model.layers.{i}.{name}", size, f"layer-{i}.safetensors")
          for i in range(N) for name, size in {**SHARDED, **REPLICATED}.items()]
    ts += [tensor(name, size, "shared.safetensors") for name, size in VOCAB.items()]
    ts.append(T("model.norm.weight", FINAL_NORM, "shared.safetensors"))
    return meta(ts, N, num_attention_heads=heads, num_key_value_heads=kv_heads, **config)


def member_bytes(layers: int, tp: int) -> int:
    """What one member of a group of ``tp`` holds: by hand, from the tensor sizes above."""
    def part(n: int) -> int:
        return -(-n // tp)
    per_layer = sum(REPLICATED.values()) + part(sum(SHARDED.values()))
    return FINAL_NORM + part(sum(VOCAB.values())) + layers * per_layer


# --- The groups -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("size", [4, 8])
@pytest.mark.parametrize("strategy", ["even", "memory", "balanced"])
def test_groups_of_consecutive_ranks_share_a_stage(tp: int, size: int, strategy: str) -> None:
    plan = make_plan(llama(), hosts(size, memory_gb=64), strategy=strategy, tp=tp)
    stages = size // tp
    assert (plan.tp, len(plan.split), sum(plan.split), len(plan.ranks)) == (tp, stages, N, size)
    assert [(r.rank, r.stage, r.tp_index) for r in plan.ranks] == [(r, r // tp, r % tp) for r in range(size)]
    for r in plan.ranks:  # every member runs its stage's layers and fetches its stage's whole files
        first = plan.ranks[r.stage * tp]
        assert (r.start, r.end, r.files, r.weight_bytes) == (first.start, first.end, first.files, first.weight_bytes)
        layers = (f"layer-{i}.safetensors" for i in range(r.start, r.end))
        assert r.files == tuple(sorted(["shared.safetensors", *layers]))
        assert r.weight_bytes == member_bytes(r.layers, tp)
    # Stage 0 runs the last layers, as rank 0 does without --tp.
    assert plan.ranks[0].end == N and plan.ranks[-1].start == 0
    assert sum(r.work_share for r in plan.ranks) == pytest.approx(1.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_split_is_the_strategy_over_stages(tp: int) -> None:
    """Equal hosts: the split over stages is the one the strategy gives that many hosts without --tp."""
    with_tp = make_plan(llama(), hosts(8, memory_gb=64), strategy="even", tp=tp)
    assert list(with_tp.split) == even_split(N, 8 // tp)


def test_a_stage_s_budget_is_its_smallest_member_s() -> None:
    plan = make_plan(llama(), wired(10, 2, 10, 10), strategy="memory", tp=2)
    assert list(plan.split) == proportional_split(N, [2, 10])
    assert [r.budget_bytes for r in plan.ranks] == [10 * 1024**3, 2 * 1024**3, 10 * 1024**3, 10 * 1024**3]


def test_an_explicit_split_is_per_stage() -> None:
    plan = make_plan(llama(), hosts(4), split=(3, 5), tp=2)
    assert [(r.start, r.end) for r in plan.ranks] == [(5, 8), (5, 8), (0, 5), (0, 5)]
    with pytest.raises(UsageError, match=r"--split has 4 entries but --tp 2 makes 2 stages of the hostfile's 4 hosts"):
        make_plan(llama(), hosts(4), split=(2, 2, 2, 2), tp=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_cache_splits_by_kv_heads(tp: int) -> None:
    plan = make_plan(llama(), hosts(4), strategy="even", tp=tp)
    per_token = 2 * 4 * 16 * 2  # K and V, 4 KV heads of 16, bf16
    for r in plan.ranks:
        assert r.kv_bytes_per_1k == r.layers * per_token * 1000 // tp


def test_mla_kv_cache_is_whole_on_every_member() -> None:
    plan = make_plan(llama(kv_lora_rank=32, qk_rope_head_dim=8), hosts(2), tp=2)
    assert all(r.kv_bytes_per_1k == N * (32 + 8) * 2 * 1000 for r in plan.ranks)
    assert "whole on every member" in " ".join(plan.notes)


def test_the_fit_check_is_per_member() -> None:
    """A model no host holds alone fits on a group of 2 that splits it; a small member fails alone."""
    kv = 64 * KB  # more than the KV cache of 16 tokens (8 layers x 2 x 4 heads x 16 x 2 bytes x 16)
    whole = member_bytes(N, 1) + RUNTIME_OVERHEAD + kv  # the weights, the runtime, the KV cache
    half = member_bytes(N, 2) + RUNTIME_OVERHEAD + kv
    budget = (half + whole) / 2 / 1024**3
    assert not make_plan(llama(), wired(budget), context=16).fits
    assert make_plan(llama(), wired(budget, budget), context=16, tp=2).fits
    small = make_plan(llama(), wired(budget, budget / 4), context=16, tp=2)
    assert [r.fits for r in small.ranks] == [True, False]


def quantized_llama() -> tuple[Any, int, int]:
    """A 4-bit llama as mlx-community's: every matrix a packed uint32 ``weight`` (1/4 of bf16's bytes) with
    bf16 ``scales`` and ``biases`` (a value each per group of 64); returns it, the bytes of its head and
    embedding, and of one layer's matrices."""
    def parts(name: str, bf16_bytes: int, file: str) -> list[Any]:
        rows = 64
        columns = bf16_bytes // 2 // rows
        return [Tensor(f"{name}.weight", "U32", (rows, columns // 8), file),
                Tensor(f"{name}.scales", "BF16", (rows, columns // 64), file),
                Tensor(f"{name}.biases", "BF16", (rows, columns // 64), file)]

    ts = [t for i in range(N) for name, size in SHARDED.items()
          for t in parts(f"model.layers.{i}.{name.removesuffix('.weight')}", size, f"layer-{i}.safetensors")]
    ts += [tensor(f"model.layers.{i}.{name}", size, f"layer-{i}.safetensors")
           for i in range(N) for name, size in REPLICATED.items()]
    vocab = [t for name, size in VOCAB.items() for t in parts(name.removesuffix(".weight"), size, "shared.safetensors")]
    ts += [*vocab, T("model.norm.weight", FINAL_NORM, "shared.safetensors")]
    layer = sum(t.nbytes for t in ts if t.name.startswith("model.layers.0.") and len(t.shape) == 2)
    return meta(ts, N, num_attention_heads=8, num_key_value_heads=4), sum(t.nbytes for t in vocab), layer


def test_a_quantized_head_and_embedding_are_split_by_vocabulary_too() -> None:
    """The worker splits a quantized head and embedding by vocabulary rows (packed weights, scales, biases):
    each member of a group counts 1/N of all three."""
    model, vocab, layer = quantized_llama()
    assert vocab == sum(VOCAB.values()) * 9 // 32  # 4-bit: 1/4 of bf16's bytes, scales and biases 1/64 each
    for tp in (1, 2, 4):
        plan = make_plan(model, hosts(4), strategy="even", tp=tp)
        per_layer = sum(REPLICATED.values()) + -(-layer // tp)
        assert all(r.weight_bytes == FINAL_NORM + -(-vocab // tp) + r.layers * per_layer for r in plan.ranks), tp


def test_notes_say_what_is_split() -> None:
    notes = " ".join(make_plan(llama(), hosts(4), tp=2).notes)
    assert "--tp 2: 2 pipeline stages" in notes and "vocabulary head and embedding (split by vocabulary)" in notes
    assert "--tp" not in " ".join(make_plan(llama(), hosts(4)).notes)


@pytest.mark.parametrize("name, shape, replicated", [
    ("model.layers.0.mlp.switch_mlp.gate_proj.weight", (8, 32, 64), False),  # routed experts: split
    ("model.layers.0.mlp.switch_mlp.down_proj.weight", (8, 64, 32), False),
    ("model.layers.0.mlp.shared_expert.up_proj.weight", (32, 64), False),  # a shared expert: split
    ("model.layers.0.mlp.gate.weight", (8, 64), True),  # the router: whole, every member routes alike
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), True),
    ("model.layers.0.block_sparse_moe.router.layer.weight", (8, 64), True),
])
def test_moe_experts_split_and_routers_replicated(name: str, shape: tuple[int, ...], replicated: bool) -> None:
    """As the worker shards them (``worker/tensor/experts.py``): each expert by its hidden width."""
    from mlxpipe.plan.costs import is_replicated

    assert is_replicated(name, shape) is replicated
    assert "MoE experts included" in " ".join(make_plan(llama(), hosts(2), tp=2).notes)


def test_tp_1_is_the_pipeline_unchanged() -> None:
    assert make_plan(llama(), hosts(4), tp=1) == make_plan(llama(), hosts(4))


# --- Refusals: one line, with what would work -------------------------------------------------


@pytest.mark.parametrize(
    ("model", "size", "tp", "error", "hint"),
    [
        (llama(), 4, 0, "--tp 0: a tensor-parallel group needs at least 1 host", "use --tp 1 (pipeline only)"),
        (llama(), 6, 4, "--tp 4: the hostfile's 6 hosts do not split into groups of 4", "use --tp 1, 2, 3 or 6"),
        (llama(heads=6, kv_heads=6), 4, 4, "--tp 4: test/model has 6 attention heads (num_attention_heads), "
         "not divisible by 4", "use --tp 2, 3 or 6 (divisors of its attention heads)"),
        (llama(heads=8, kv_heads=2), 4, 4, "--tp 4: test/model has 2 KV heads (num_key_value_heads), "
         "not divisible by 4", "use --tp 2 (divisors of its KV heads)"),
        (llama(heads=8, kv_heads=1), 2, 2, "--tp 2: test/model has 1 KV heads", "its KV heads cannot be split"),
    ],
    ids=["zero", "hosts", "heads", "kv-heads", "one-kv-head"],
)
def test_refused_with_what_would_work(model: Any, size: int, tp: int, error: str, hint: str) -> None:
    from mlxpipe.plan.tensor import check_tp

    with pytest.raises(UsageError) as caught:
        check_tp(tp, size)
        make_plan(model, hosts(size), tp=tp)
    assert caught.value.message.startswith(error) and caught.value.hint.startswith(hint)


def test_per_layer_head_counts_are_each_checked() -> None:
    config = {"num_query_heads": [4, 6], "num_kv_heads": [2, 2], "model_type": "openelm"}
    from mlxpipe.plan.tensor import check_heads

    check_heads(config, 2, "m")
    with pytest.raises(UsageError, match=r"m has 6 attention heads \(num_query_heads\), not divisible by 4"):
        check_heads(config, 4, "m")


def test_more_stages_than_layers() -> None:
    with pytest.raises(PlanError, match="--tp 2 makes 16 stages but the model has only 8 layers"):
        make_plan(llama(), hosts(32), tp=2)


# --- The command line ---------------------------------------------------------------------------


def test_plan_json_shape(tp_llama: Path, four_macs: Path) -> None:
    result = invoke("plan", "--model", str(tp_llama), "--hostfile", str(four_macs), "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["tp"], data["split"], data["fits"]) == (2, [3, 3], True)
    assert [(r["rank"], r["host"], r["stage"], r["tp_index"], r["start"], r["end"]) for r in data["ranks"]] == [
        (0, "mac-0", 0, 0, 3, 6), (1, "mac-1", 0, 1, 3, 6), (2, "mac-2", 1, 0, 0, 3), (3, "mac-3", 1, 1, 0, 3),
    ]


def test_plan_table_shows_the_groups(tp_llama: Path, four_macs: Path) -> None:
    result = invoke("plan", "--model", str(tp_llama), "--hostfile", str(four_macs), "--tp", "2")
    assert result.exit_code == 0, result.output
    assert "--tp 2: 2 stages of 2 ranks" in result.stdout
    rows = [[c.strip() for c in line.split("│")[1:4]] for line in result.stdout.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert rows == [["0", "0 · 0", "mac-0"], ["1", "0 · 1", "mac-1"], ["2", "1 · 0", "mac-2"], ["3", "1 · 1", "mac-3"]]


LAUNCHING = {  # every value they need; the flag under test is refused before the model is read
    "plan": ["plan", "--model", "unread"],
    "download": ["download", "--model", "unread", "--dry-run"],
    "generate": ["generate", "--model", "unread", "--prompt", "hi"],
    "prompts-file": ["generate", "--model", "unread", "--prompts-file", "unread.txt"],
    "chat": ["chat", "--model", "unread"],
    "serve": ["serve", "--model", "unread"],
    "doctor": ["doctor"],
}


@pytest.mark.parametrize("command", LAUNCHING, ids=list(LAUNCHING))
@pytest.mark.parametrize(("tp", "error"), [
    ("3", "error: --tp 3: the hostfile's 2 hosts do not split into groups of 3\n"
          "hint: use --tp 1 or 2 with these hosts, or list a multiple of 3 hosts\n"),
    ("0", "error: --tp 0: a tensor-parallel group needs at least 1 host\n"
          "hint: use --tp 1 (pipeline only) or a divisor of the number of hosts\n"),
], ids=["hosts", "zero"])
def test_bad_tp_exits_2_before_anything_runs(
    command: str, tp: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the default hostfile: hostfiles/local-2.json
    result = invoke(*LAUNCHING[command], "--tp", tp)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", error)


def test_heads_not_divisible_exits_2(tp_llama: Path, four_macs: Path) -> None:
    result = invoke("plan", "--model", str(tp_llama), "--hostfile", str(four_macs), "--tp", "4")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"error: --tp 4: {tp_llama} has 2 KV heads (num_key_value_heads), not divisible by 4\n"
                             "hint: use --tp 2 (divisors of its KV heads)\n")


def test_lora_with_tp_is_refused() -> None:
    result = invoke("lora", "--model", "unread", "--train", "--tp", "2")
    assert (result.exit_code, result.stderr) == (
        2, "error: --tp 2: LoRA training does not run on tensor-parallel groups yet\n"
           "hint: drop --tp: each rank trains its own layers of the pipeline\n")


def test_preset_gives_tp_and_the_flag_wins(tp_llama: Path, four_macs: Path, tmp_path: Path) -> None:
    preset = tmp_path / "tp.yaml"
    preset.write_text(f"model: {tp_llama}\ntp: 4\n")
    base = ("plan", "--hostfile", str(four_macs), "--config", str(preset), "--json")
    refused = invoke(*base)  # the preset's 4 does not divide the model's 2 KV heads
    assert refused.exit_code == 2 and "--tp 4:" in refused.stderr
    assert json.loads(invoke(*base, "--tp", "2").stdout)["tp"] == 2
    preset.write_text(f"model: {tp_llama}\ntp: 3\n")
    assert invoke(*base).stderr.startswith(f"error: {preset}: key 'tp' 3: the hostfile's 4 hosts do not split")


def test_pipeline_native_is_refused_with_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    result = invoke("generate", "--model", "unread", "--prompt", "hi", "--tp", "2", "--pipeline", "native")
    assert (result.exit_code, result.stderr) == (2, "error: --tp 2 needs the generic pipeline\n"
                                                    "hint: drop --pipeline native\n")
