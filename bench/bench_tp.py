"""Tensor parallelism (``--tp``): single-stream decode and time to first token, ranks pinned one per core.

Rows: single-process mlx-lm; mlxpipe's 2-stage pipeline; mlxpipe ``--tp 2``;
mlx-lm's own ``model.shard(group)`` on the same 2 ranks (as mlx_lm.server runs
under mlx.launch); then aggregate decode tok/s at concurrency 4 and 8 for the
pipeline and ``--tp 2``. The ranks run this file as their driver under
``mlx.launch`` (mlxpipe's worker code loads the ``JobSpec``, as the tests do),
each pinned to its own core before MLX starts its threads. The ``--tp 2`` and
``shard()`` rows come from one launch whose ranks hold both models and take
turns, ``REPEATS`` generations each after a warm-up, and report the median:
launch-to-launch differences on this VM (±15% between identical launches) are
larger than the difference measured.

Goal (issue 22): ``--tp 2`` >= 1.5x single-process decode on 2 pinned ranks, ahead of mlx-lm's ``shard()``.

    python bench/bench_tp.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import QWEN2_BENCH, QWEN2_LAYERS, REPO, build_qwen2, cpu_name, placement, rank_cores, run_pinned

REPEATS = 5  # measured generations per row in a launch; the median is reported
PROMPT = "Explain how tensor parallelism splits one transformer layer across two machines, step by step."


# --- on the ranks (run under mlx.launch) ------------------------------------------------


def _pin_self(ranks: int) -> None:
    rank = int(os.environ.get("MLX_RANK", "0"))
    os.sched_setaffinity(0, {rank_cores(ranks)[rank]})  # before MLX starts its threads: they inherit it
    # As mlxpipe's controller does (launch.ranks.lower_priority): mlx.launch's I/O threads spin on
    # the ranks' stdin and, left at normal priority, take ~1.6 cores from the pinned ranks (measured
    # here: a 40x768 @ 768x1024 matmul loop in a rank ran 2.1-3.6 s, 0.7-0.9 s once it was reniced,
    # 0.62 s in a lone pinned process). Every launched row (mlxpipe's and mlx-lm's shard()) gets it.
    from mlxpipe.launch.ranks import lower_priority

    lower_priority(os.getppid())


def _rank_main(spec: dict[str, Any]) -> None:
    """One rank: load the job (and, for the pair, mlx-lm's shard() too), run the single streams (a warm-up,
    then ``REPEATS`` each, taking turns), then the batches; rank 0 prints."""
    sys.path.insert(0, str(REPO))
    _pin_self(spec["ranks"])
    import mlx.core as mx

    from mlxpipe.protocol.job import JobSpec
    from mlxpipe.protocol.messages import Batch
    from mlxpipe.protocol.request import Request
    from mlxpipe.worker.generation.loop import RankLoop
    from mlxpipe.worker.groups import init_group
    from mlxpipe.worker.load import barrier, load_rank

    job = JobSpec(**spec["job"])
    group = init_group(job.world_size)
    server = RankLoop(load_rank(job, group), group, job, emit=lambda event: None)
    request = Request(prompt=PROMPT, max_tokens=spec["max_tokens"])

    def mlxpipe_stream() -> dict[str, float]:
        done = server.generate(request)
        return {"ttft": done.ttft or 0.0, "tps": done.generation_tps}

    streams = {"single": mlxpipe_stream}
    if spec.get("with_shard"):
        from mlx_lm import load, stream_generate

        model, tokenizer = load(spec["model"], lazy=True)
        model.shard(group)  # mlx-lm's own tensor parallelism on the world group, as mlx_lm.server runs it
        mx.eval(model.parameters())
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

        def shard_stream() -> dict[str, float]:
            last = None
            for last in stream_generate(model, tokenizer, prompt, max_tokens=spec["max_tokens"]):
                pass
            return {"ttft": last.prompt_tokens / last.prompt_tps, "tps": last.generation_tps}

        streams["shard"] = shard_stream
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in streams}
    for repeat in range(REPEATS + 1):  # the first is a warm-up
        for name, stream in streams.items():
            figures = stream()
            if repeat:
                runs[name].append(figures)
    out: dict[str, Any] = {name: _median(figures) for name, figures in runs.items()}
    for k in spec["concurrency"]:
        requests = tuple(Request(prompt=f"{PROMPT} ({i})", max_tokens=spec["max_tokens"]) for i in range(k))
        result = server.generate_batch(Batch(requests, concurrency=k, decode_batch=k))
        out[f"k{k}"] = result.generation_tokens / result.seconds
    barrier(group)
    if group.rank() == 0:
        print("BENCH " + json.dumps(out), flush=True)


def _median(figures: list[dict[str, float]]) -> dict[str, Any]:
    """The median decode rate's run (its time to first token with it), and every rate, for the table."""
    ranked = sorted(figures, key=lambda f: f["tps"])
    return {**ranked[len(ranked) // 2], "all": [round(f["tps"], 2) for f in figures]}


# --- the controller ---------------------------------------------------------------------


def _launch(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.ranks import PYTHON, launch, local_hostfile

    spec_file = tmp / f"{spec['name']}.json"
    spec_file.write_text(json.dumps(spec))
    result = launch(local_hostfile(spec["ranks"], tmp), [PYTHON, __file__, "--rank", str(spec_file)],
                    timeout=1800.0)
    for line in result.stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])
    raise RuntimeError(f"{spec['name']}: no figures\n{result.describe()}")


def _single_main(model: str, max_tokens: int) -> None:
    from mlx_lm import load, stream_generate

    model_, tokenizer = load(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    figures = []
    for repeat in range(REPEATS + 1):  # the first is a warm-up
        last = None
        for last in stream_generate(model_, tokenizer, prompt, max_tokens=max_tokens):
            pass
        if repeat:
            figures.append({"ttft": last.prompt_tokens / last.prompt_tps, "tps": last.generation_tps})
    print("BENCH " + json.dumps({"single": _median(figures)}))


def _job(model: Path, tmp: Path, split: list[int], tp: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.ranks import rank_dirs
    from mlxpipe.protocol.job import JobSpec

    dirs = rank_dirs(model, split, tmp / f"dirs-{'-'.join(map(str, split))}-tp{tp}")
    return asdict(JobSpec([str(d) for d in dirs for _ in range(tp)], split, tp=tp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens (a smoke run)")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--single", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return _rank_main(json.loads(Path(args.rank).read_text()))
    if args.single:
        return _single_main(args.single[0], int(args.single[1]))
    layers = 8 if args.quick else QWEN2_LAYERS
    max_tokens = 16 if args.quick else 64
    concurrency = [4, 8]
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        model = build_qwen2(tmp / "qwen2", layers=layers)
        rows: list[tuple[str, str, dict[str, Any]]] = []
        single = run_pinned(__file__, ["--single", str(model), str(max_tokens)])
        rows.append(("single process (mlx-lm)", placement(0),
                     json.loads(single.stdout.split("BENCH ", 1)[1])))
        half = [layers // 2, layers - layers // 2]
        common = {"ranks": 2, "max_tokens": max_tokens, "concurrency": concurrency}
        pipeline = _launch({"name": "pipeline", "job": _job(model, tmp, half, 1), **common}, tmp)
        pair = _launch({"name": "tp", "job": _job(model, tmp, [layers], 2), "with_shard": True,
                        "model": str(model), **common}, tmp)
        rows.append(("mlxpipe 2-stage pipeline", placement(2), pipeline))
        rows.append(("mlxpipe --tp 2", placement(2), pair))
        rows.append(("mlx-lm shard() on 2 ranks (same launch, taking turns)", placement(2), {"single": pair["shard"]}))
    base = rows[0][2]["single"]["tps"]
    print(f"\n## Tensor parallelism: single stream (qwen2 float32, {layers} layers, hidden "
          f"{QWEN2_BENCH['hidden_size']}, {max_tokens} tokens)\n")
    print("| setup | placement | TTFT (s) | decode tok/s (median) | vs single | every run's tok/s |")
    print("|---|---|---:|---:|---:|---|")
    for name, where, figures in rows:
        s = figures["single"]
        print(f"| {name} | {where} | {s['ttft']:.3f} | {s['tps']:.2f} | {s['tps'] / base:.2f}x | "
              f"{', '.join(map(str, s['all']))} |")
    print("\n## Aggregate decode tok/s (all requests' tokens / the batch's wall time)\n")
    print("| setup | " + " | ".join(f"concurrency {k}" for k in concurrency) + " |")
    print("|---|" + "---:|" * len(concurrency))
    for name, _, figures in rows[1:3]:
        print(f"| {name} | " + " | ".join(f"{figures[f'k{k}']:.2f}" for k in concurrency) + " |")
    print(f"\nMedian of {REPEATS} generations after a warm-up; ranks on loopback (ring), each pinned to a core "
          f"of its own; {cpu_name()}, {os.cpu_count()} CPUs. "
          "Goal: --tp 2 >= 1.5x single process, ahead of mlx-lm's shard().")


if __name__ == "__main__":
    main()
