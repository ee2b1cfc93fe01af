"""Training tokens/s of ``mlxpipe lora`` on 2 pinned ranks against single-process mlx_lm.lora (issue 12).

    python bench/bench_lora.py            # what `make bench` runs (a few minutes)
    python bench/bench_lora.py --quick    # smoke run: fewer, shorter steps

The same batches (mlx_lm.lora's own ``iterate_batches``, seed 0) are trained:

* by single-process mlx_lm.lora (``train_model``: its compiled step), pinned to one core;
* by one launch of 2 local ranks (``mlxpipe.lora.training``: what ``mlxpipe lora`` runs), each worker
  pinned to a core of its own, under every schedule in turn: naive (one micro-batch),
  GPipe and 1F1B with M = 2, 4, 8 micro-batches.

Tokens/s counts the tokens the loss counts, over the wall time of every step but
each setup's first (a warm-up), as mlx_lm.lora's report does. A second single-process
row trains the same number of sequences one at a time: on a CPU a small batch can
cost less per token, which the pipeline's micro-batches profit from too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, build_qwen2, cores, pin_workers, placement, run_pinned

MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64}
LAYERS = 8
BATCH = 8
SEQ_CHARS = 64  # the tiny tokenizer is byte-level: 64 tokens a sequence
SETUPS = [("1f1b", 1)] + [(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)]  # one micro-batch: naive
GOALS = {"1f1b_vs_naive": 1.6, "1f1b_vs_single": 1.5}


@dataclass
class Row:
    how: str
    micro: int
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def build(dest: Path) -> tuple[Path, Path]:
    """A random float32 qwen2 and a text dataset of equal-length lines."""
    model = build_qwen2(dest / "model", LAYERS, MODEL, shards=3)
    data = dest / "data"
    data.mkdir()
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home", "in", "the",
             "rain"]
    for name, n in (("train", 64), ("valid", 8)):
        lines = []
        for _ in range(n):
            text = ""
            while len(text) < SEQ_CHARS:
                text += rng.choice(words) + " "
            lines.append(json.dumps({"text": text[:SEQ_CHARS]}))
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return model, data


def options_for(model: Path, data: Path, out: Path, iters: int, batch: int = BATCH) -> Any:
    from mlxpipe.lora.options import TrainOptions

    return TrainOptions.build({"model": str(model), "train": True, "data": str(data), "batch_size": batch,
                               "iters": iters, "num_layers": -1, "learning_rate": 1e-5, "val_batches": 0,
                               "adapter_path": str(out), "steps_per_report": 1, "save_every": 10**6})


def single_process(model: Path, data: Path, out: Path, iters: int, batch: int = BATCH) -> Row:
    args = ["--single-process", str(model), str(data), str(out), "--iters", str(iters), "--batch", str(batch)]
    result = run_pinned(__file__, args, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-2000:])
    tokens, seconds = json.loads(result.stdout.strip().splitlines()[-1])
    how = "mlx_lm.lora, single process" + ("" if batch == BATCH else f", batch {batch}")
    return Row(how, 1, tokens, seconds)


def _single_process_main(model: str, data: str, out: str, iters: int, batch: int) -> None:
    import numpy as np
    from mlx_lm import lora as mlx_lora
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import load

    options = options_for(Path(model), Path(data), Path(out), iters, batch)
    args = types.SimpleNamespace(**{**mlx_lora.CONFIG_DEFAULTS, **options.mlx_lm_args().__dict__})
    reports: list[dict[str, Any]] = []

    class Record(TrainingCallback):
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            reports.append(info)

    np.random.seed(args.seed)
    loaded, tokenizer = load(model)
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    mlx_lora.train_model(args, loaded, train_set, valid_set, Record())
    later = reports[1:]  # the first step compiles: a warm-up
    tokens = sum(r["tokens_per_second"] / r["iterations_per_second"] for r in later)
    seconds = sum(1 / r["iterations_per_second"] for r in later)
    print(json.dumps([tokens, seconds]))


@contextlib.contextmanager
def training_launch(model: Path, options: Any, pinned: bool) -> Iterator[types.SimpleNamespace]:
    """2 local ranks loaded to train with ``options`` (each worker pinned to a core of its own if ``pinned``):
    the pipe, the metadata, the plan, the datasets and the step requests of the training data."""
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.launch.run import launch, prepare
    from mlxpipe.lora.batches import load_datasets, requests
    from mlxpipe.protocol.messages import Step

    target = resolve_target(str(model), None, REPO / "hostfiles" / "local-2.json", None, None, None)
    config = PipelineConfig(target, quiet=True, timeout=600)
    meta, the_plan = prepare(config)
    datasets = load_datasets(options, controller_model_dir(meta))
    steps = [r for r in requests(options, datasets, None) if isinstance(r, Step)]
    pipe = launch(config, meta, the_plan, train=options.for_ranks())
    try:
        if pinned:
            pin_workers(pipe.job.encode(), 2)
        yield types.SimpleNamespace(pipe=pipe, meta=meta, plan=the_plan, datasets=datasets, steps=steps)
    except BaseException:
        pipe.stop()
        raise
    pipe.close()


def pipeline_rows(model: Path, data: Path, out: Path, steps: int) -> list[Row]:
    """Every setup, ``steps`` steps each, on one launch of 2 pinned ranks."""
    from dataclasses import replace

    from mlxpipe.lora.training import Reporter, Training

    options = options_for(model, data, out, steps * len(SETUPS))
    rows = []
    with training_launch(model, options, pinned=True) as run:
        for i, (schedule, micro) in enumerate(SETUPS):
            todo = [replace(b, micro_batches=micro, schedule=schedule) for b in run.steps[i * steps:(i + 1) * steps]]
            result = Training(run.pipe, options, Reporter()).run(iter(todo))
            later = result.steps[1:]
            how = "naive (one micro-batch)" if micro == 1 else schedule
            rows.append(Row(how, micro, sum(s.tokens for s in later), sum(s.seconds for s in later)))
            print(f"  {how}, M = {micro}: {rows[-1].tps:.1f} tok/s", file=sys.stderr)
    return rows


MEMORY_SETUPS = [("1f1b", 1), ("gpipe", 2), ("gpipe", 8), ("1f1b", 8)]


def memory_table(model: Path, data: Path, out: Path) -> str:
    """Each rank's peak memory against the plan's estimate, one launch of 2 steps per setup
    (a rank's peak is its largest since it started)."""
    from dataclasses import replace

    from mlxpipe.lora.batches import longest_sequence
    from mlxpipe.lora.training import Reporter, Training
    from mlxpipe.plan.training import training_memory

    lines = ["| setup | rank | layers | estimated | measured peak | measured / estimated |",
             "|---|---:|---|---:|---:|---:|"]
    for schedule, micro in MEMORY_SETUPS:
        options = replace(options_for(model, data, out, 2), micro_batches=micro, schedule=schedule)
        with training_launch(model, options, pinned=False) as run:
            todo = [replace(r, micro_batches=micro, schedule=schedule) for r in run.steps]
            result = Training(run.pipe, options, Reporter()).run(iter(todo))
        estimate = training_memory(run.meta, run.plan, options, longest_sequence(run.datasets.train))
        peaks = {r.rank: r.peak_memory_gb * 1e9 for r in result.ranks}
        how = "naive" if micro == 1 else schedule
        for m, r in zip(estimate, run.plan.ranks, strict=True):
            lines.append(f"| {how}, M = {micro} | {m.rank} | {r.start}-{r.end - 1} | {m.total_bytes / 1e6:.1f} MB | "
                         f"{peaks[m.rank] / 1e6:.1f} MB | {peaks[m.rank] / m.total_bytes:.2f} |")
    return "\n".join(lines)


def table(single: Row, small: Row, rows: list[Row]) -> str:
    naive = next(r.tps for r in rows if r.micro == 1)
    lines = ["| setup | placement | M | trained tok/s | vs naive | vs single process |",
             "|---|---|---:|---:|---:|---:|",
             f"| {single.how} | {placement(0)} | - | {single.tps:.1f} | - | 1.00x |",
             f"| {small.how} (M = 8's micro-batch alone) | {placement(0)} | - | {small.tps:.1f} | - | "
             f"{small.tps / single.tps:.2f}x |"]
    for r in rows:
        lines.append(f"| 2 ranks, {r.how} | {placement(2)} | {r.micro} | {r.tps:.1f} | {r.tps / naive:.2f}x | "
                     f"{r.tps / single.tps:.2f}x |")
    return "\n".join(lines)


def verdict(single: Row, rows: list[Row]) -> str:
    naive = next(r.tps for r in rows if r.micro == 1)
    best = max((r for r in rows if r.how == "1f1b"), key=lambda r: r.tps)
    a, b = best.tps / naive, best.tps / single.tps
    return (f"Goals: best 1F1B (M = {best.micro}) {a:.2f}x the naive schedule (goal {GOALS['1f1b_vs_naive']}x: "
            f"{'met' if a >= GOALS['1f1b_vs_naive'] else 'NOT met'}), {b:.2f}x single-process mlx_lm.lora "
            f"(goal {GOALS['1f1b_vs_single']}x: {'met' if b >= GOALS['1f1b_vs_single'] else 'NOT met'}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps per setup")
    parser.add_argument("--steps", type=int, default=4, help="steps per setup, the first a warm-up")
    parser.add_argument("--single-process", nargs=3, metavar=("MODEL", "DATA", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single_process:
        _single_process_main(*args.single_process, iters=args.iters, batch=args.batch)
        return
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build(Path(tmp))
        print(f"model: random float32 qwen2, {LAYERS} layers, hidden {MODEL['hidden_size']}; batch {BATCH} x "
              f"~{SEQ_CHARS} tokens; all layers LoRA (rank 8)", file=sys.stderr)
        tic = time.perf_counter()
        single = single_process(model, data, Path(tmp) / "single", steps)
        print(f"  single process: {single.tps:.1f} tok/s", file=sys.stderr)
        # The same tokens in batches of one sequence: what a micro-batch of M = 8 costs on one core.
        small = single_process(model, data, Path(tmp) / "single-1", steps * BATCH, batch=BATCH // 8)
        print(f"  single process, batch {BATCH // 8}: {small.tps:.1f} tok/s", file=sys.stderr)
        rows = pipeline_rows(model, data, Path(tmp) / "pipe", steps)
        print(table(single, small, rows))
        print()
        print(verdict(single, rows))
        print()
        print(memory_table(model, data, Path(tmp) / "memory"))
        print(f"(bench took {time.perf_counter() - tic:.0f} s; {len(cores())} usable cores)")


if __name__ == "__main__":
    main()
