"""How long ``mlxpipe plan`` takes on DeepSeek-V3-sized metadata (target: under 1 s, metadata cached).

    python bench/bench_plan.py            # what `make bench` runs
    python bench/bench_plan.py --runs 9

Synthesizes DeepSeek-V3's layout, 4-bit as mlx-lm quantizes it: 61 layers
(3 dense, 58 MoE with 256 routed experts stored per expert as
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,scales,biases}``),
the MTP layer 61, in 163 shards. Each shard is a real safetensors file whose
data is a hole (written header + ``truncate``), so ~380 GB of apparent size
costs a few MB of disk. The same metadata is also stored in mlxpipe's metadata
cache under a hub repo id, as a first ``plan`` of that repo would leave it.

Times (median of --runs): the in-process core (``load_metadata`` + validate +
``make_plan``) and the console script end to end, for the local directory
(every header read each time) and the cached hub repo.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import REPO

HOSTFILE = REPO / "hostfiles" / "mac-studio-4-thunderbolt.yaml"
HUB_REPO = "bench-org/DeepSeek-V3-synthetic-4bit"
HUB_COMMIT = "d5e1f2a3b4c5d6e7f8091a2b3c4d5e6f70819203"
TARGET_S = 1.0
NUM_SHARDS = 163

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "quantization": {"group_size": 64, "bits": 4},
}

Spec = tuple[str, str, list[int]]  # name, dtype, shape


def quantized(name: str, out: int, inp: int) -> list[Spec]:
    """A 4-bit, group-64 linear layer as mlx-lm stores it."""
    return [(f"{name}.weight", "U32", [out, inp // 8]), (f"{name}.scales", "BF16", [out, inp // 64]),
            (f"{name}.biases", "BF16", [out, inp // 64])]


def layer_tensors(i: int) -> list[Spec]:
    c = CONFIG
    h, heads, p = c["hidden_size"], c["num_attention_heads"], f"model.layers.{i}"
    out = [(f"{p}.input_layernorm.weight", "BF16", [h]), (f"{p}.post_attention_layernorm.weight", "BF16", [h]),
           (f"{p}.self_attn.q_a_layernorm.weight", "BF16", [c["q_lora_rank"]]),
           (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", [c["kv_lora_rank"]])]
    out += quantized(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h)
    q_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out += quantized(f"{p}.self_attn.q_b_proj", heads * q_head, c["q_lora_rank"])
    out += quantized(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
    out += quantized(f"{p}.self_attn.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    out += quantized(f"{p}.self_attn.o_proj", h, heads * c["v_head_dim"])
    if i < c["first_k_dense_replace"]:
        return out + mlp(f"{p}.mlp", c["intermediate_size"])
    out += [(f"{p}.mlp.gate.weight", "BF16", [c["n_routed_experts"], h]),
            (f"{p}.mlp.gate.e_score_correction_bias", "F32", [c["n_routed_experts"]])]
    for e in range(c["n_routed_experts"]):
        out += mlp(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"])
    return out + mlp(f"{p}.mlp.shared_experts", c["moe_intermediate_size"])


def mlp(prefix: str, inter: int) -> list[Spec]:
    h = CONFIG["hidden_size"]
    return quantized(f"{prefix}.gate_proj", inter, h) + quantized(f"{prefix}.up_proj", inter, h) + quantized(
        f"{prefix}.down_proj", h, inter
    )


def all_tensors() -> list[Spec]:
    c = CONFIG
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    out = quantized("model.embed_tokens", v, h)
    for i in range(n):
        out += layer_tensors(i)
    # The MTP layer (num_nextn_predict_layers = 1), dropped by mlx-lm's sanitize.
    mtp = f"model.layers.{n}"
    out += layer_tensors(n) + [(f"{mtp}.enorm.weight", "BF16", [h]), (f"{mtp}.hnorm.weight", "BF16", [h]),
                                (f"{mtp}.shared_head.norm.weight", "BF16", [h])]
    out += quantized(f"{mtp}.eh_proj", h, 2 * h) + quantized(f"{mtp}.shared_head.head", v, h)
    out += quantized(f"{mtp}.embed_tokens", v, h)
    return out + [("model.norm.weight", "BF16", [h])] + quantized("lm_head", v, h)


_WIDTH = {"U32": 4, "BF16": 2, "F32": 4}


def nbytes(spec: Spec) -> int:
    size = _WIDTH[spec[1]]
    for d in spec[2]:
        size *= d
    return size


def write_checkpoint(directory: Path) -> tuple[int, int]:
    """Write the synthetic checkpoint; return (tensor count, total weight bytes)."""
    tensors = all_tensors()
    total = sum(nbytes(t) for t in tensors)
    per_shard = total / NUM_SHARDS
    files = [f"model-{i + 1:05d}-of-{NUM_SHARDS:06d}.safetensors" for i in range(NUM_SHARDS)]
    shards: list[list[Spec]] = [[] for _ in files]
    done = 0
    for t in tensors:  # in checkpoint order, so layers straddle shard boundaries as they do on the hub
        shards[min(int(done / per_shard), NUM_SHARDS - 1)].append(t)
        done += nbytes(t)
    weight_map = {}
    for name, specs in zip(files, shards, strict=True):
        write_sparse_safetensors(directory / name, specs)
        weight_map.update({t[0]: name for t in specs})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (directory / "tokenizer_config.json").write_text("{}")
    return len(tensors), total


def write_sparse_safetensors(path: Path, specs: list[Spec]) -> None:
    """A valid safetensors file whose data region is a hole."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, dtype, shape in specs:
        size = nbytes((name, dtype, shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def seed_hub_cache(directory: Path) -> None:
    """Store the metadata as a first ``plan`` of ``HUB_REPO`` would have (in $MLXPIPE_HOME)."""
    from mlxpipe.hub import client as hub
    from mlxpipe.model.metadata import load_local

    local = load_local(directory)
    meta = dataclasses.replace(local, source=HUB_REPO, revision="main", commit=HUB_COMMIT, local=False)
    hub._store(meta, "main")  # the cache's own writer, so the layout cannot drift


def median_time(fn: Callable[[], Any], runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def in_process(model: str) -> Callable[[], Any]:
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.hub.client import load_metadata
    from mlxpipe.model.metadata import validate
    from mlxpipe.plan.shard import make_plan

    def run() -> Any:
        meta = load_metadata(model)
        validate(meta)
        plan = make_plan(meta, load_hostfile(HOSTFILE).hosts)
        assert plan.fits and plan.num_layers == 61, plan
        return plan

    return run


def console_script() -> list[str]:
    script = Path(sys.executable).parent / "mlxpipe"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlxpipe"]


def cli(model: str, *extra: str) -> Callable[[], Any]:
    args = [*console_script(), "plan", "--model", model, "--hostfile", str(HOSTFILE), *extra]

    def run() -> None:
        proc = subprocess.run(args, capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-") as tmp:
        root = Path(tmp)
        # Own cache and an unreachable hub: a cache miss would fail, not fetch.
        os.environ.update(
            MLXPIPE_HOME=str(root / "mlxpipe-home"), HF_HOME=str(root / "hf-home"),
            HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        )
        model = root / "DeepSeek-V3-synthetic-4bit"
        model.mkdir()
        start = time.perf_counter()
        count, total = write_checkpoint(model)
        seed_hub_cache(model)
        setup = time.perf_counter() - start
        on_disk = sum(p.stat().st_blocks * 512 for p in model.iterdir())
        print(
            f"DeepSeek-V3-sized metadata: {CONFIG['num_hidden_layers']} layers + MTP layer 61, "
            f"{NUM_SHARDS} shards, {count:,} tensors, {total / 1024**3:.1f} GiB of weights "
            f"({on_disk / 1024**2:.1f} MiB on disk); built in {setup:.1f} s\n"
        )
        cases = [
            ("in-process: load_metadata + make_plan", "hub repo, cached", in_process(HUB_REPO)),
            ("in-process: load_metadata + make_plan", "local dir, 163 headers", in_process(str(model))),
            ("mlxpipe plan --json (subprocess)", "hub repo, cached", cli(HUB_REPO, "--json")),
            ("mlxpipe plan (table, subprocess)", "hub repo, cached", cli(HUB_REPO)),
            ("mlxpipe plan --json (subprocess)", "local dir, 163 headers", cli(str(model), "--json")),
        ]
        print(f"| {'what':<40} | {'metadata':<23} | median (s) | min (s) | < {TARGET_S:g} s |")
        print(f"|{'-' * 42}|{'-' * 25}|-----------:|--------:|:-----:|")
        for what, source, fn in cases:
            med, best = median_time(fn, args.runs)
            ok = "yes" if med < TARGET_S else "NO"
            print(f"| {what:<40} | {source:<23} | {med:10.3f} | {best:7.3f} | {ok:^5} |")
        print(f"\nmedian of {args.runs} runs; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
