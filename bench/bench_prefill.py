"""Prefill speed of one long prompt: single-process mlx-lm against pipelines (issue 10).

    python bench/bench_prefill.py            # what `make bench` runs (about 8 minutes on 2 cores)
    python bench/bench_prefill.py --quick    # smoke run: one short prompt per setup

A random float32 qwen2 (12 layers, hidden 512, as the issue measured it) gets a
prompt of ~600 and of ~2,000 tokens (no chat template) and generates one token.
The figure is prompt tok/s as mlx-lm reports it (prompt tokens / time to the
first token), the median of --runs after one warm-up.

* Single process: mlx-lm's ``stream_generate`` with its default prefill step
  (2048), pinned to one core.
* mlxpipe: ``mlxpipe.launch.pipeline.Pipeline`` through ``running_pipeline`` (what ``mlxpipe generate`` runs) on 2 and
  3 local ranks, each worker pinned to a core of its own where the machine has
  enough. The default prefill chunk (128) lets a prompt's chunks flow through
  the stages one behind the other; the 2048 row is one chunk, so one stage at a
  time computes (what `mlxpipe generate` did before it ran on the engine).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import build_qwen2, cores, cpu_name, pinned_pipeline, placement, run_pinned

QWEN2_PREFILL = {
    "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
}
QWEN2_LAYERS = 12
LENGTHS = (600, 2000)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly",
         "judge", "boxing", "matches"]


@dataclass(frozen=True)
class Setup:
    label: str
    ranks: int  # 0: single-process mlx-lm
    prefill_step: int | None = None  # None: mlxpipe's default for the setup


SETUPS = [
    Setup("mlx-lm, single process (step 2048)", 0),
    # The pipeline's chunk size on one process: how much of the gain is the chunk size itself.
    Setup("mlx-lm, single process (step 128)", 0, 128),
    Setup("mlxpipe, one 2048-token chunk", 2, 2048),
    Setup("mlxpipe, default chunks (128)", 2),
    Setup("mlxpipe, default chunks (128)", 3),
]


def prompt_text(tokenizer: object, length: int) -> str:
    """Words until the prompt is ``length`` tokens long (within one word)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < length:  # type: ignore[attr-defined]
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


def single_process(model: Path, length: int, runs: int, step: int | None) -> list[float]:
    args = ["--single-process", str(model), "--length", str(length), "--runs", str(runs), "--step", str(step or 2048)]
    out = run_pinned(__file__, args).stdout
    return json.loads(out.strip().splitlines()[-1])


def _single_process_main(model: str, length: int, runs: int, step: int) -> None:
    from mlx_lm import load, stream_generate

    loaded, tokenizer = load(model)
    prompt = tokenizer.encode(prompt_text(tokenizer, length))
    speeds = []
    for i in range(runs + 1):
        response = None
        for response in stream_generate(loaded, tokenizer, prompt, max_tokens=1, prefill_step_size=step):
            pass
        if i > 0:
            speeds.append(response.prompt_tps)
    print(json.dumps(speeds))


def pipeline(model: Path, setup: Setup, lengths: tuple[int, ...], runs: int) -> dict[int, list[float]]:
    """Prompt tok/s per prompt length on local ranks, each worker pinned."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxpipe.launch.pipeline import Request, request_for

    tokenizer = load_tokenizer(model)
    sampling = Request(max_tokens=1, ignore_chat_template=True)
    speeds: dict[int, list[float]] = {}
    with pinned_pipeline(model, setup.ranks, prefill_step_size=setup.prefill_step) as pipe:
        for length in lengths:
            prompt = prompt_text(tokenizer, length)
            for i in range(runs + 1):
                answer = pipe.generate(request_for(prompt, None, sampling))
                if i > 0:
                    speeds.setdefault(length, []).append(answer.prompt_tps)
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 200-token prompt, one run per setup")
    parser.add_argument("--runs", type=int, default=2, help="timed prefills per setup and length")
    parser.add_argument("--single-process", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single_process:
        _single_process_main(args.single_process, args.length, args.runs, args.step)
        return
    lengths = (200,) if args.quick else LENGTHS
    runs = 1 if args.quick else args.runs

    with tempfile.TemporaryDirectory() as tmp:
        model = build_qwen2(Path(tmp) / "qwen2", QWEN2_LAYERS, QWEN2_PREFILL, shards=6)
        rows: list[tuple[Setup, dict[int, list[float]]]] = []
        for setup in SETUPS:
            if setup.ranks == 0:
                rows.append((setup, {n: single_process(model, n, runs, setup.prefill_step) for n in lengths}))
            else:
                rows.append((setup, pipeline(model, setup, lengths, runs)))
            print(f"  done: {setup.label}, {setup.ranks or 1} rank(s)", file=sys.stderr)

    single = {n: statistics.median(rows[0][1][n]) for n in lengths}
    header = " | ".join(f"~{n} tokens" for n in lengths)
    print(f"| setup | ranks | placement | {header} |")
    print("|---|---:|---|" + "---:|" * len(lengths))
    for setup, speeds in rows:
        cells = []
        for n in lengths:
            med = statistics.median(speeds[n])
            cells.append(f"{med:.1f} ({med / single[n]:.2f}x)")
        print(f"| {setup.label} | {setup.ranks or 1} | {placement(setup.ranks)} | {' | '.join(cells)} |")
    import mlx.core as mx
    import mlx_lm

    print(f"\n- {cpu_name()}, {len(cores())} usable cores, {platform.system()} {platform.machine()}; "
          f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; ring over 127.0.0.1.")
    print(f"- Prompt tok/s (prompt tokens / time to first token), median of {runs} after a warm-up; "
          "qwen2 12 layers, hidden 512, float32, random weights, no chat template, 1 generated token.")


if __name__ == "__main__":
    main()
