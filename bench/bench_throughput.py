"""Aggregate throughput of overlapped requests (issue 6): K = 1, 2, 4 in flight on 2 and 3 ranks;
``--prompts-file`` at its defaults against ``--decode-batch 1`` (issue 25); then batched decode
micro-batches (issue 10): concurrency 1 to 16 on 2 ranks, B = 1 vs batched.

    python bench/bench_throughput.py            # what `make bench` runs (about 10 minutes)
    python bench/bench_throughput.py --quick    # smoke run: fewer, shorter requests
    python bench/bench_throughput.py --decode-batching   # only the batched-decode table
    python bench/bench_throughput.py --defaults          # only --prompts-file at the defaults (issue 25)

The same batch of greedy requests (different prompts, same length) runs:

* one after the other in single-process mlx-lm (``stream_generate``, one core);
* one after the other through the single-stream pipeline (``Pipeline.generate``,
  what ``mlxpipe generate --prompt`` runs);
* overlapped, K at a time (``Pipeline.generate_batch``, what
  ``mlxpipe generate --prompts-file --concurrency K`` runs).

Aggregate tok/s is every generated token over the wall time of the whole batch
(prefill included), measured the same way for each. The goal: at 2 ranks,
overlapping gives at least 1.7x the single-stream pipeline. Then the demo model under
`--strategy even` and `--strategy balanced` (overlapped, K = 2): what weighing
rank 0's vocabulary head gives.

At the defaults (issue 25): a smaller float32 qwen2 (12 layers, hidden 512), K = 1, 2, 4 in
flight on 2 pinned ranks, each K at the default ``--decode-batch`` and at ``--decode-batch 1``,
under the default split. The goal: K = 2 at least 1.5x K = 1 at the defaults (batching must not
cost the overlap).

Batched decode: at concurrency C on 2 pinned ranks, C requests of the same
qwen2 run once with one request per decode micro-batch (B = 1, what mlxpipe did
before micro-batches were batched) and once with B = C / 2 (every stage runs a
group of C / 2 requests; ``--concurrency C --decode-batch C/2``). The goal:
batched >= 1.3x B = 1 at C = 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import QWEN2_LAYERS, build_qwen2, cores, pinned_pipeline, placement, run_pinned

from mlxpipe.defaults import DEFAULT_DECODE_BATCH

GOAL = 1.7
CONCURRENCY = (1, 2, 4)
BATCH_GOAL = 1.3  # batched vs B = 1 at concurrency 8, on 2 ranks
DEFAULTS_GOAL = 1.5  # K = 2 vs K = 1 at the defaults, on 2 ranks (issue 25)
SMALL_LAYERS = 12  # issue 25's model: qwen2, 12 layers, hidden 512
QWEN2_SMALL = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 64}
BATCH_CONCURRENCY = (1, 2, 4, 8, 16)
TOPICS = ["dragons", "rivers", "clocks", "bridges", "gardens", "comets", "harbours", "lanterns"]


@dataclass
class Row:
    ranks: int  # 0: single-process mlx-lm
    how: str
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def prompts(count: int) -> list[str]:
    return [f"A short poem about {TOPICS[i % len(TOPICS)]}:" for i in range(count)]


def single_process(model: Path, texts: list[str], max_tokens: int) -> Row:
    args = ["--single-process", str(model), "--max-tokens", str(max_tokens), "--prompts", json.dumps(texts)]
    out = run_pinned(__file__, args).stdout
    tokens, seconds = json.loads(out.strip().splitlines()[-1])
    return Row(0, "mlx-lm single process, one request at a time", tokens, seconds)


def _single_process_main(model: str, texts: list[str], max_tokens: int) -> None:
    from mlx_lm import load, stream_generate

    loaded, tokenizer = load(model)

    def run(text: str, n: int) -> int:
        response = None
        for response in stream_generate(loaded, tokenizer, text, max_tokens=n):  # raw, as --ignore-chat-template
            pass
        return response.generation_tokens

    run(texts[0], 4)  # warm-up
    tic = time.perf_counter()
    tokens = sum(run(t, max_tokens) for t in texts)
    print(json.dumps([tokens, time.perf_counter() - tic]))


def _requests(texts: list[str], max_tokens: int) -> list[Any]:
    from mlxpipe.launch.pipeline import Request, request_for

    sampling = Request(max_tokens=max_tokens, ignore_chat_template=True)
    return [request_for(t, None, sampling) for t in texts]


def pipeline_rows(model: Path, ranks: int, texts: list[str], max_tokens: int) -> list[Row]:
    """Single-stream, then K = 1, 2, 4 overlapped, on one launch of ``ranks`` pinned ranks."""
    requests = _requests(texts, max_tokens)
    rows = []
    with pinned_pipeline(model, ranks) as pipe:
        pipe.generate(_requests(texts[:1], 4)[0])  # warm-up
        tic = time.perf_counter()
        tokens = sum(pipe.generate(r).generation_tokens for r in requests)
        rows.append(Row(ranks, "single-stream pipeline, one request at a time", tokens, time.perf_counter() - tic))
        for k in CONCURRENCY:
            tic = time.perf_counter()
            result = pipe.generate_batch(requests, concurrency=k)
            rows.append(Row(ranks, f"overlapped, K = {k}", result.generation_tokens, time.perf_counter() - tic))
    return rows


def split_rows(
    model: Path, texts: list[str], max_tokens: int, k: int = 2, runs: int = 3
) -> list[tuple[str, list[int], list[float]]]:
    """Overlapped K = 2 on 2 pinned ranks under the even and the balanced split: (strategy, split, tok/s per run)."""
    requests = _requests(texts, max_tokens)
    rows = []
    for strategy in ("even", "balanced"):
        with pinned_pipeline(model, 2, strategy=strategy) as pipe:
            pipe.generate_batch(requests[:k], concurrency=k)  # warm-up
            tps = []
            for _ in range(runs):
                tic = time.perf_counter()
                tokens = pipe.generate_batch(requests, concurrency=k).generation_tokens
                tps.append(tokens / (time.perf_counter() - tic))
        rows.append((strategy, list(pipe.plan.split), tps))
    return rows


def defaults_rows(model: Path, texts: list[str], max_tokens: int, runs: int) -> list[tuple[int, int, list[float]]]:
    """``--prompts-file --concurrency K`` on 2 pinned ranks at the default split, with the default decode batch
    and with 1: (K, B, aggregate tok/s per run). B = default and B = 1 alternate, so drifting load hits both."""
    requests = _requests(texts, max_tokens)
    rows: dict[tuple[int, int], list[float]] = {}
    with pinned_pipeline(model, 2) as pipe:
        pipe.generate_batch(requests[:2], concurrency=2, decode_batch=DEFAULT_DECODE_BATCH)  # warm-up
        for _ in range(runs):
            for k in CONCURRENCY:
                for b in (DEFAULT_DECODE_BATCH, 1):
                    tic = time.perf_counter()
                    tokens = pipe.generate_batch(requests, concurrency=k, decode_batch=b).generation_tokens
                    rows.setdefault((k, b), []).append(tokens / (time.perf_counter() - tic))
                    print(f"  K = {k}, B = {b}: {rows[(k, b)][-1]:.2f} tok/s", file=sys.stderr, flush=True)
        split = list(pipe.plan.split)
    print(f"  split (rank order): {split}", file=sys.stderr, flush=True)
    return [(k, b, tps) for (k, b), tps in rows.items()]


def defaults_table(rows: list[tuple[int, int, list[float]]]) -> str:
    base = {b: statistics.median(tps) for k, b, tps in rows if k == 1}
    lines = ["| K in flight | --decode-batch | aggregate tok/s (median) | runs | vs K = 1 (same B) |",
             "|---:|---:|---:|---|---:|"]
    for k, b, tps in sorted(rows, key=lambda r: (r[1] == 1, r[0])):
        median = statistics.median(tps)
        runs = ", ".join(f"{t:.2f}" for t in tps)
        lines.append(f"| {k} | {b}{' (default)' if b == DEFAULT_DECODE_BATCH else ''} | {median:.2f} | {runs} "
                     f"| {median / base[b]:.2f}x |")
    return "\n".join(lines)


def defaults_verdict(rows: list[tuple[int, int, list[float]]]) -> str:
    by = {(k, b): statistics.median(tps) for k, b, tps in rows}
    ratio = by[(2, DEFAULT_DECODE_BATCH)] / by[(1, DEFAULT_DECODE_BATCH)]
    return (f"Goal (issue 25): at the defaults, K = 2 >= {DEFAULTS_GOAL:g}x K = 1: {ratio:.2f}x, "
            f"{'met' if ratio >= DEFAULTS_GOAL else 'NOT met'}.")


def decode_batching_rows(model: Path, max_tokens: int, runs: int = 1,
                         concurrency: tuple[int, ...] = BATCH_CONCURRENCY) -> list[tuple[int, int, list[float], dict]]:
    """On 2 pinned ranks: (concurrency C, B, aggregate tok/s per run, where the time went) for B = 1 and B = C / 2."""
    rows = []
    with pinned_pipeline(model, 2) as pipe:
        pipe.generate_batch(_requests(prompts(4), 4), concurrency=4, decode_batch=2)  # warm-up
        for c in concurrency:
            requests = _requests(prompts(c), max_tokens)
            batches = sorted({1, max(1, c // 2)})
            tps: dict[int, list[float]] = {b: [] for b in batches}
            spent: dict[int, dict] = {}
            for _ in range(runs):  # B = 1 and batched alternate, so drifting load on a shared machine hits both
                for b in batches:
                    tic = time.perf_counter()
                    result = pipe.generate_batch(requests, concurrency=c, decode_batch=b)
                    tps[b].append(result.generation_tokens / (time.perf_counter() - tic))
                    spent[b] = result.summary()["time"]
                    print(f"  C = {c}, B = {b}: {tps[b][-1]:.2f} tok/s", file=sys.stderr, flush=True)
            rows += [(c, b, tps[b], spent[b]) for b in batches]
    return rows


def single_process_batching(model: Path) -> str:
    """What batching gains in one process on one core: mlx-lm's model on B rows of merged caches vs one row."""
    return run_pinned(__file__, ["--single-process-batching", str(model)]).stdout.strip()


def _single_process_batching_main(path: str) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(path)

    def cache(i: int) -> list[Any]:
        c = make_prompt_cache(model)
        model(mx.array([[1 + i] * (20 + i)]), cache=c)  # ragged prompts: left padding, as in the engine
        mx.eval([x.state for x in c])
        return c

    def step(c: list[Any], b: int) -> float:
        tic = time.perf_counter()
        mx.eval(model(mx.array([[5]] * b), cache=c), [x.state for x in c])
        return time.perf_counter() - tic

    setups = {1: cache(0), **{
        b: [layer[0].merge(list(layer)) for layer in zip(*(cache(i) for i in range(b)), strict=True)]
        for b in (2, 4, 8)
    }}
    best = {b: min(step(c, b) for _ in range(25)) for b, c in setups.items()}  # best of 25: least disturbed
    print(" | ".join(f"B = {b}: {best[1] * b / t:.2f}x" for b, t in best.items()))
    print(f"Why: one matmul of a 768 x 4864 weight on the same core costs {_matmul_rows()}")


def _matmul_rows() -> str:
    """What B rows cost against one: float32 and 4-bit weights (best of 30 each)."""
    import mlx.core as mx

    w = mx.random.normal((4864, 768)) * 0.02
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    kinds = {"float32": lambda x: x @ w.T,
             "4-bit": lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)}
    out = []
    for name, f in kinds.items():
        times = {}
        for rows in (1, 4, 8):
            x = mx.random.normal((rows, 768))
            mx.eval(x, f(x))
            samples = []
            for _ in range(30):
                tic = time.perf_counter()
                mx.eval(f(x))
                samples.append(time.perf_counter() - tic)
            times[rows] = min(samples)
        out.append(f"{name} " + ", ".join(f"{r} rows {t * 1e3:.2f} ms" for r, t in times.items()))
    return "; ".join(out) + " (time grows with the rows: batching has no weight reads to share here)"


def decode_batching_table(rows: list[tuple[int, int, list[float], dict]]) -> str:
    unbatched = {c: statistics.median(t) for c, b, t, _ in rows if b == 1}
    lines = ["| concurrency C | B | aggregate tok/s (median) | runs | vs B = 1 | busy rank 0 / rank 1 "
             "| hop 1->0 wait |",
             "|---:|---:|---:|---|---:|---|---:|"]
    for c, b, tps, spent in rows:
        med = statistics.median(tps)
        busy = " / ".join(f"{r['busy']:.0%}" for r in spent.get("ranks", []))
        hop = spent["hops"][0]["wait_s"] if spent.get("hops") else 0.0
        lines.append(f"| {c} | {b} | {med:.2f} | {', '.join(f'{t:.2f}' for t in tps)} | "
                     f"{med / unbatched[c]:.2f}x | {busy} | {hop:.1f} s |")
    return "\n".join(lines)


def decode_batching_verdict(rows: list[tuple[int, int, list[float], dict]]) -> str:
    at8 = {b: statistics.median(t) for c, b, t, _ in rows if c == 8}
    if 1 not in at8 or len(at8) < 2:
        return ""
    ratio = max(v for b, v in at8.items() if b > 1) / at8[1]
    met = "met" if ratio >= BATCH_GOAL else "NOT met"
    return f"Goal (2 ranks, C = 8, batched >= {BATCH_GOAL}x B = 1): {ratio:.2f}x, {met}."


def split_table(rows: list[tuple[str, list[int], list[float]]]) -> str:
    even = statistics.median(rows[0][2])
    lines = ["| strategy | split (rank 0, rank 1) | aggregate tok/s, K = 2 (median) | runs | vs even |",
             "|---|---|---:|---|---:|"]
    for strategy, split, tps in rows:
        med = statistics.median(tps)
        runs = ", ".join(f"{t:.2f}" for t in tps)
        lines.append(f"| {strategy} | {split[0]}, {split[1]} | {med:.2f} | {runs} | {med / even:.2f}x |")
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = [
        "| ranks | placement (rank->core) | how | tokens | seconds | aggregate tok/s | vs single-stream pipeline "
        "| vs single process |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    single = next(r.tps for r in rows if r.ranks == 0)
    stream: dict[int, float] = {}
    for r in rows:
        if r.how.startswith("single-stream"):
            stream[r.ranks] = r.tps
        vs_stream = f"{r.tps / stream[r.ranks]:.2f}x" if r.ranks in stream else "-"
        lines.append(
            f"| {r.ranks or 1} | {placement(r.ranks)} | {r.how} | {r.tokens} | {r.seconds:.1f} | "
            f"{r.tps:.2f} | {vs_stream} | {r.tps / single:.2f}x |"
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    stream = next(r.tps for r in rows if r.ranks == 2 and r.how.startswith("single-stream"))
    best = max(r.tps for r in rows if r.ranks == 2 and r.how.startswith("overlapped"))
    ok = "met" if best >= GOAL * stream else "NOT met"
    return f"Goal (2 ranks, overlapped >= {GOAL}x single-stream): {best / stream:.2f}x, {ok}."


def notes(count: int, max_tokens: int) -> str:
    shared = len(cores()) < 3
    lines = [
        f"- Model: random float32 qwen2, {QWEN2_LAYERS} layers, hidden 768, split evenly; {count} greedy requests "
        f"(different one-line prompts of ~25 tokens, no chat template), {max_tokens} tokens each; one launch per "
        "rank count serves every pipeline row, after a warm-up request.",
        "- Aggregate tok/s = all generated tokens / wall time of the whole batch (prefill included), taken the "
        "same way for every row. Single process: `taskset -c` to one core.",
        "- Pipeline workers pinned (every thread, sched_setaffinity) once loaded; mlx.launch reniced to 19 by the "
        "controller. MLX's ring backend busy-waits: a waiting rank burns its core.",
    ]
    if shared:
        lines.append(
            f"- {len(cores())} usable cores: 2 ranks get one each; 3 ranks cannot, so rank 2 shares rank 0's core "
            "and the 3-rank rows measure contention as much as the pipeline."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 requests of 8 tokens (smoke run)")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--decode-batching", action="store_true", help="only the batched-decode table")
    parser.add_argument("--defaults", action="store_true", help="only the table of --prompts-file at the defaults")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens per request in the batched-decode table")
    parser.add_argument("--batch-runs", type=int, default=3, help="runs per row of the batched-decode table")
    parser.add_argument("--batch-concurrency", default=",".join(map(str, BATCH_CONCURRENCY)),
                        help="concurrency levels of the batched-decode table, comma-separated")
    parser.add_argument("--single-process", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--single-process-batching", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 4, 8
    if args.single_process:
        _single_process_main(args.single_process, json.loads(args.prompts), args.max_tokens)
        return
    if args.single_process_batching:
        _single_process_batching_main(args.single_process_batching)
        return
    texts = prompts(args.requests)
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-") as tmp:
        os.environ.setdefault("MLXPIPE_HOME", str(Path(tmp) / "home"))
        model = build_qwen2(Path(tmp) / "qwen2-bench")
        batch_tokens = 8 if args.quick else args.batch_tokens
        if args.defaults:
            small = build_qwen2(Path(tmp) / "qwen2-small", SMALL_LAYERS, QWEN2_SMALL)
            defaults = defaults_rows(small, prompts(4), 8 if args.quick else 48, 1 if args.quick else 3)
            print(defaults_table(defaults))
            print()
            print(defaults_verdict(defaults))
            return
        if args.decode_batching:
            print("measuring batched decode on 2 ranks...", file=sys.stderr, flush=True)
            levels = tuple(int(c) for c in args.batch_concurrency.split(","))
            print(decode_batching_report(model, decode_batching_rows(model, batch_tokens, args.batch_runs, levels),
                                         batch_tokens))
            return
        print("measuring single-process mlx-lm...", file=sys.stderr, flush=True)
        rows = [single_process(model, texts, args.max_tokens)]
        for ranks in (2, 3):
            print(f"measuring {ranks} ranks...", file=sys.stderr, flush=True)
            rows += pipeline_rows(model, ranks, texts, args.max_tokens)
        print("measuring --prompts-file at the defaults and at --decode-batch 1 (12-layer qwen2)...",
              file=sys.stderr, flush=True)
        small = build_qwen2(Path(tmp) / "qwen2-small", SMALL_LAYERS, QWEN2_SMALL)
        defaults = defaults_rows(small, prompts(4), 48, 1 if args.quick else 3)
        print("measuring the demo model's even and balanced splits...", file=sys.stderr, flush=True)
        from mlxpipe.model.demo import ensure_demo_model

        splits = split_rows(ensure_demo_model(), texts, args.max_tokens, runs=1 if args.quick else 3)
        print("measuring batched decode on 2 ranks...", file=sys.stderr, flush=True)
        batching = decode_batching_rows(model, batch_tokens, 1 if args.quick else args.batch_runs)
        batching_report = decode_batching_report(model, batching, batch_tokens)  # while the model is there
    print(table(rows))
    print()
    print(verdict(rows))
    print()
    print(notes(args.requests, args.max_tokens))
    print()
    print(f"--prompts-file at the defaults, 2 pinned ranks, float32 qwen2 of {SMALL_LAYERS} layers and hidden 512, "
          "4 prompts of 48 tokens, K = --concurrency:")
    print()
    print(defaults_table(defaults))
    print()
    print(defaults_verdict(defaults))
    print()
    print("Where the stages meet: the demo model (SmolLM2-135M, its tied 8-bit vocabulary head worth ~13 of its 30")
    print("4-bit layers in bytes) with `--strategy even` and `--strategy balanced`, the same batch, 2 pinned ranks:")
    print()
    print(split_table(splits))
    print()
    print("Batched decode micro-batches, 2 pinned ranks, the same qwen2:")
    print()
    print(batching_report)


def decode_batching_report(model: Path, batching: list[tuple[int, int, list[float], dict]], max_tokens: int) -> str:
    """The batched-decode table, its verdict, single-process mlx-lm's batching gain on ``model``, the notes."""
    return "\n\n".join([
        decode_batching_table(batching),
        decode_batching_verdict(batching),
        f"Single process, one core, tok/s of B rows vs one row: {single_process_batching(model)}",
        decode_batching_notes(max_tokens),
    ])


def decode_batching_notes(max_tokens: int) -> str:
    return "\n".join([
        f"- C greedy requests (one-line prompts of ~10 tokens, no chat template), {max_tokens} tokens each, all "
        "admitted at once; aggregate tok/s = generated tokens / wall time of the batch (prefill included, small).",
        "- B = 1: one request per decode micro-batch (C above 2 only waits); B = C / 2: each of the 2 stages "
        "runs a group of C / 2 requests with batched KV caches.",
        "- busy: the share of each rank's time spent computing its stage; hop wait: rank 0's time waiting for "
        "rank 1's hidden states.",
    ])


if __name__ == "__main__":
    main()
