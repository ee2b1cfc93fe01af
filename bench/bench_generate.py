"""Generation speed: single-process mlx-lm against pipelines on 2 and 3 ranks (issue 4).

    python bench/bench_generate.py            # what `make bench` runs (about 3 minutes)
    python bench/bench_generate.py --quick    # smoke run: one short generation per setup
    python bench/bench_generate.py --draft    # speculative decoding (--draft-model) on 2 ranks instead

Two checkpoints, each measured the same ways in one run:

* the demo model (SmolLM2-135M-Instruct, 30 layers, 4-bit with float32 scales);
* a random float32 qwen2 of 20 layers, hidden 768 (built here; qwen2 has mlx-lm's
  own ``pipeline()``, so the native pipeline runs on it too).

Single-process mlx-lm runs ``stream_generate`` pinned to one core. The pipelines
run through ``mlxpipe.launch.pipeline.Pipeline`` (what ``mlxpipe generate`` runs, the
mlx.launch renice included) with each worker pinned to a core of its own where
the machine has enough; the figure is mlx-lm's generation tok/s as rank 0
reports it, the median of --runs generations after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import QWEN2_LAYERS, build_qwen2, cores, cpu_name, pinned_pipeline, placement, rank_cores, run_pinned

PROMPT = "Tell me a story."
WARMUP_TOKENS = 8
DRAFT_LAYERS = 8  # --draft: a cheap draft made of the demo model's first layers
NUM_DRAFT_TOKENS = 3  # mlx_lm.generate's default


@dataclass(frozen=True)
class Setup:
    """One line of the table: how a model is run."""

    label: str
    ranks: int  # 0: single-process mlx-lm
    mode: str = "generic"


SETUPS = [
    Setup("mlx-lm, single process", 0),
    Setup("mlxpipe generic", 2),
    Setup("mlx-lm native pipeline()", 2, "native"),
    Setup("mlxpipe generic", 3),
    Setup("mlx-lm native pipeline()", 3, "native"),
]


@dataclass
class Row:
    model: str
    setup: Setup
    placement: str
    tps: list[float]
    tokens: int


# --- measurements ---------------------------------------------------------------------


def single_process(model: Path, runs: int, max_tokens: int, draft: Path | None = None) -> list[float]:
    """Generation tok/s of single-process mlx-lm, pinned to the first core, in a subprocess."""
    args = ["--single-process", str(model), "--runs", str(runs), "--max-tokens", str(max_tokens)]
    if draft is not None:
        args += ["--draft-model", str(draft)]
    out = run_pinned(__file__, args).stdout
    return json.loads(out.strip().splitlines()[-1])


def _single_process_main(model: str, runs: int, max_tokens: int, draft: str | None = None) -> None:
    from mlx_lm import load, stream_generate

    loaded, tokenizer = load(model)
    drafting = {"draft_model": load(draft)[0], "num_draft_tokens": NUM_DRAFT_TOKENS} if draft else {}
    prompt = _prompt_tokens(tokenizer)
    speeds = []
    for i in range(runs + 1):
        response = None
        for response in stream_generate(loaded, tokenizer, prompt, max_tokens=WARMUP_TOKENS if i == 0 else max_tokens,
                                        **drafting):
            pass
        if i > 0:
            speeds.append(response.generation_tps)
    print(json.dumps(speeds))


def _prompt_tokens(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def pipeline(model: Path, setup: Setup, runs: int, max_tokens: int, draft: Path | None = None,
             drafted: list[int] | None = None) -> tuple[list[float], int]:
    """Generation tok/s of a pipeline on local ranks, each worker pinned; and tokens per run
    (``drafted`` gets each run's accepted draft tokens)."""
    from mlxpipe.launch.pipeline import Request, request_for

    drafting = {"draft_model": str(draft), "num_draft_tokens": NUM_DRAFT_TOKENS} if draft else {}
    with pinned_pipeline(model, setup.ranks, mode=setup.mode, **drafting) as pipe:
        speeds, tokens = [], 0
        for i in range(runs + 1):
            sampling = Request(max_tokens=WARMUP_TOKENS if i == 0 else max_tokens)
            answer = pipe.generate(request_for(PROMPT, None, sampling))
            if i > 0:
                speeds.append(answer.generation_tps)
                tokens = answer.generation_tokens
                if drafted is not None and answer.draft_tokens is not None:
                    drafted.append(answer.draft_tokens)
    return speeds, tokens


def build_short_draft(model: Path, dest: Path, layers: int = DRAFT_LAYERS) -> Path:
    """A draft model made of ``model``'s first ``layers`` blocks (same tokenizer, same quantization)."""
    import shutil

    import mlx.core as mx

    dest.mkdir(parents=True, exist_ok=True)
    weights: dict[str, Any] = {}
    for f in model.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    kept = {k: v for k, v in weights.items()
            if not (".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= layers)}
    mx.save_safetensors(str(dest / "model.safetensors"), kept, metadata={"format": "mlx"})
    config = json.loads((model / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json") and f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def draft_main(runs: int, max_tokens: int) -> None:
    """Speculative decoding: generation tok/s without a draft and with two drafts, single process and 2 ranks."""
    from mlxpipe.model.demo import ensure_demo_model

    demo = ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-") as tmp:
        os.environ.setdefault("MLXPIPE_HOME", str(Path(tmp) / "home"))
        drafts = {
            "none": None,
            "the demo model itself (every draft accepted: an upper bound on acceptance)": demo,
            f"the demo model's first {DRAFT_LAYERS} of 30 layers (a poor draft: nearly every draft rejected)":
                build_short_draft(demo, Path(tmp) / "short"),
        }
        lines = ["| draft model (k = 3) | mlx-lm, single process | mlxpipe, 2 ranks | drafted tokens accepted |",
                 "|---|---:|---:|---:|"]
        for label, draft in drafts.items():
            print(f"measuring draft {label}...", file=sys.stderr, flush=True)
            single = statistics.median(single_process(demo, runs, max_tokens, draft))
            drafted: list[int] = []
            speeds, tokens = pipeline(demo, Setup("mlxpipe generic", 2), runs, max_tokens, draft, drafted)
            accepted = f"{statistics.median(drafted)} of {tokens}" if drafted else "-"
            lines.append(f"| {label} | {single:.2f} | {statistics.median(speeds):.2f} "
                         f"(runs {', '.join(f'{t:.1f}' for t in speeds)}) | {accepted} |")
    print("\n".join(lines))
    print()
    print(f"- {cpu_name()}, {len(cores())} usable cores; demo model (SmolLM2-135M 4-bit) as the target; greedy, "
          f"{max_tokens} tokens after a chat-templated prompt, median of {runs} runs after a warm-up; "
          "single process pinned to one core, each rank to its own.")


# --- the table ------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| model | setup | ranks | placement (rank->core) | gen tok/s (median) | runs | vs single process |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    single: dict[str, float] = {}
    for row in rows:
        med = statistics.median(row.tps)
        if row.setup.ranks == 0:
            single[row.model] = med
        ratio = f"{med / single[row.model]:.2f}x" if row.model in single else "-"
        runs = ", ".join(f"{t:.1f}" for t in row.tps)
        lines.append(
            f"| {row.model} | {row.setup.label} | {row.setup.ranks or 1} | {row.placement} | "
            f"{med:.2f} | {runs} | {ratio} |"
        )
    return "\n".join(lines)


def notes(runs: int, max_tokens: int, prompt_tokens: dict[str, int]) -> str:
    import mlx.core as mx
    import mlx_lm

    shared = any(len(set(rank_cores(s.ranks))) < s.ranks for s in SETUPS if s.ranks)
    prompts = ", ".join(f"{m}: {n}" for m, n in prompt_tokens.items())
    lines = [
        f"- Machine: {cpu_name()}, {len(cores())} usable cores, {platform.system()} {platform.machine()}; "
        f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; ring backend over 127.0.0.1.",
        f"- Greedy generation of {max_tokens} tokens after a chat-templated prompt (prompt tokens {prompts}); "
        f"median of {runs} generations after a {WARMUP_TOKENS}-token warm-up; tok/s as mlx-lm reports it "
        "(tokens after the first / time after the first).",
        "- Single process: `taskset -c` to one core. Pipelines: every worker thread pinned with "
        "sched_setaffinity once the ranks have loaded; mlx.launch (whose I/O threads spin) reniced to 19 "
        "by the controller, as `mlxpipe generate` does.",
        "- MLX's ring backend busy-waits: a rank waiting for its peer burns its core, so ranks sharing a "
        "core slow each other down.",
    ]
    if shared:
        lines.append(
            f"- This machine has {len(cores())} cores: 3 ranks cannot have one each, so rank 2 shares a core "
            "with rank 0 (marked shared); those rows measure contention as much as the pipeline."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 12-token generation per setup (smoke run)")
    parser.add_argument("--runs", type=int, default=3, help="timed generations per setup")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per timed generation")
    parser.add_argument("--draft", action="store_true", help="speculative decoding (--draft-model) on 2 ranks instead")
    parser.add_argument("--single-process", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--draft-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens = 1, 12
    if args.single_process:
        _single_process_main(args.single_process, args.runs, args.max_tokens, args.draft_model)
        return
    if args.draft:
        draft_main(args.runs, args.max_tokens)
        return

    from mlx_lm.utils import load_tokenizer

    from mlxpipe.model.demo import ensure_demo_model

    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-") as tmp:
        os.environ.setdefault("MLXPIPE_HOME", str(Path(tmp) / "home"))  # run logs go away with the run
        models = {
            "demo (SmolLM2-135M 4-bit)": ensure_demo_model(),
            f"qwen2 {QWEN2_LAYERS}L/768 f32": build_qwen2(Path(tmp) / "qwen2-bench"),
        }
        rows: list[Row] = []
        prompt_tokens = {}
        for name, path in models.items():
            prompt_tokens[name.split()[0]] = len(_prompt_tokens(load_tokenizer(path)))
            native = _has_native_pipeline(path)
            for setup in SETUPS:
                if setup.mode == "native" and not native:
                    continue
                print(f"measuring {name}: {setup.label} on {setup.ranks or 1} rank(s)...", file=sys.stderr, flush=True)
                if setup.ranks == 0:
                    speeds, tokens = single_process(path, args.runs, args.max_tokens), args.max_tokens
                else:
                    speeds, tokens = pipeline(path, setup, args.runs, args.max_tokens)
                rows.append(Row(name, setup, placement(setup.ranks), speeds, tokens))
    print(table(rows))
    print()
    print(notes(args.runs, args.max_tokens, prompt_tokens))


def _has_native_pipeline(path: Path) -> bool:
    """Whether mlx-lm has its own ``pipeline()`` for the model (qwen2 does; llama, the demo, does not)."""
    from mlxpipe.errors import ModelError
    from mlxpipe.worker.load import check_pipelinable

    try:
        check_pipelinable(path, mode="native")
    except ModelError:
        return False
    return True


if __name__ == "__main__":
    main()
