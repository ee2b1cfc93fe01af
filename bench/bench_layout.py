"""The layout's cost model, predicted against measured, per layout (issue 31).

    python bench/bench_layout.py                   # what `make bench` runs (about 20 minutes on 2 cores)
    python bench/bench_layout.py --quick           # one run per figure, no namespace hosts
    python bench/bench_layout.py --only namespace  # one group of cases (with --runs 1: a reduced run)

For each case, every layout is started as `mlxpipe generate` starts it (`running_pipeline`), each rank
pinned to a core of its own, and timed: single-stream decode (tok/s of 64 generated tokens), the
prefill of a 600-token prompt (prompt tok/s), and the aggregate decode of 8 requests at once
(decode batch 4); each the median of --runs after a warm-up. Beside each figure, what
`plan/estimate.py` predicts from the facts the links job measured on the same hosts just before
(`doctor --links`, the less loaded of two jobs; the machine's compute calibrated once, `--calibrate`,
and reused). Under each case, the order of its layouts by each figure, predicted and measured.

Cases (the orders `tests/e2e/test_layout.py` once asserted; on this shared 2-core machine they flipped with
the load, so they are printed here, not tested):

* 2 local ranks: a float32 qwen2 of 8 layers, hidden 512, as 1 host, a 2-stage pipeline and `--tp 2` (the
  fast link: `--tp 2` predicted ahead in decode);
* the issue's 12-layer model with a 151,936-token vocabulary (its head worth ~35 layers in bytes) on 2 local
  ranks, the 600-token prompt under the even split and under the split `--strategy balanced` gives for
  `--workload batch` (which weighs the head on every generated token; the even split predicted ahead);
* 2 namespace hosts (`tests/fixtures/cluster.py`, root only) with 0 and 5 ms added each way on one host's
  link (what `tc netem delay` would add; this machine's kernel has none, so `tests/fixtures/delay_wire.py`
  does it in user space): the 8-layer model as a pipeline and as `--tp 2` (at 5 ms the pipeline predicted
  ahead in decode); and the delay as the links job measures it, through the wire at 0 and at 5 ms.

The measuring holds /tmp/mlxpipe-ranks.lock (and the cluster lock for the namespace hosts), so no other
ranks of ours share the two cores meanwhile; the load average before and after is printed with the figures.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import REPO, cpu_name, placement

sys.path.insert(0, str(REPO / "tests"))

from fixtures.layouts import (
    BIG_VOCABULARY,
    DECODE_BATCH,
    Measured,
    added_latency,
    build_qwen2,
    measure_layout,
    predict,
)

LAYERS = 8
PROMPT = 600
CONCURRENCY = 8
DECODE_TOKENS = 64
ADDED_MS = 5.0
FIGURES = ("decode", "prefill", "aggregate")


@contextmanager
def locked(path: str) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def local_hostfile(dest: Path, ranks: int) -> Path:
    path = dest / f"local-{ranks}.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * ranks}))
    return path


def row(name: str, measured: Measured, predicted: Any, figures: tuple[str, ...]) -> dict[str, Any]:
    return {"layout": name, "split": measured.split, "figures": {
        f: {"predicted": getattr(predicted, f), "measured": getattr(measured, f), "runs": (measured.runs or {}).get(f)}
        for f in figures}}


def run_case(title: str, model: Path, hostfile: Path, layouts: list[tuple[str, int, str | None, str | None]],
             figures: tuple[str, ...], runs: int, facts: Any, after_each: Callable[[], None] | None = None
             ) -> dict[str, Any]:
    rows = []
    for name, tp, strategy, workload in layouts:
        print(f"  {title}: {name}...", file=sys.stderr, flush=True)
        m = measure_layout(model, hostfile, tp=tp, strategy=strategy, workload=workload, pin=True, figures=figures,
                           runs=runs, decode_tokens=DECODE_TOKENS, prompt=PROMPT, concurrency=CONCURRENCY)
        p = predict(model, hostfile, m.split, tp=tp, strategy=strategy or "even", prompt=PROMPT,
                    concurrency=CONCURRENCY, facts=facts)
        rows.append(row(name, m, p, figures))
        if after_each is not None:
            after_each()  # the namespace hosts: no ssh session of this layout left to share the cores
    return {"title": title, "rows": rows, "figures": figures, "links": links_text(facts)}


def calibrate(hostfile: Path) -> Any:
    """This machine's compute, from a links job with --calibrate on ``hostfile`` (two local ranks)."""
    from mlxpipe.launch.links_job import measure

    return measure(hostfile, calibrate=True).hosts[0].calibration


def links_facts(hostfile: Path, calibration: Any) -> Any:
    """The facts of the less loaded of two links jobs on ``hostfile`` (a wait for a core during one inflates
    its latency, which --tp 2 pays twice a layer), with ``calibration``, written beside the hostfile."""
    from mlxpipe.cluster.facts_file import write_facts
    from mlxpipe.launch.links_job import measure

    facts = min((measure(hostfile) for _ in range(2)), key=lambda f: f.links[0].latency)
    facts = facts.with_calibration(calibration)
    write_facts(facts, hostfile)
    return facts


def links_text(facts: Any) -> str:
    if not facts.links:
        return "one host: no link"
    link = facts.links[0]
    collective = f", collective {facts.collective * 1e3:.2f} ms" if facts.collective is not None else ""
    return f"links job: latency {link.latency * 1e3:.3f} ms, bandwidth {link.bandwidth / 1e9:.2f} GB/s{collective}"


def one_host_facts(facts: Any, hostfile: Path) -> Any:
    """The facts of the first host alone (no link), for the 1-host hostfile of the same machine."""
    from dataclasses import replace

    from mlxpipe.cluster.facts_file import write_facts

    single = replace(facts, hosts=facts.hosts[:1], links=(), collective=None, addresses=facts.addresses[:1])
    write_facts(single, hostfile)
    return single


def local_cases(tmp: Path, runs: int, calibration: Any) -> list[dict[str, Any]]:
    model = build_qwen2(tmp / "qwen2-8", LAYERS)
    two, one = local_hostfile(tmp, 2), local_hostfile(tmp, 1)
    facts = links_facts(two, calibration)
    single = one_host_facts(facts, one)
    cases = [run_case("1 host", model, one, [("1 host", 1, None, None)], FIGURES, runs, single)]
    cases.append(run_case("2 local ranks", model, two, [("pipeline (balanced = even)", 1, None, None),
                                                         ("--tp 2", 2, None, None)], FIGURES, runs, facts))
    big = build_qwen2(tmp / "qwen2-12-vocab", 12, BIG_VOCABULARY)
    cases.append(run_case("2 local ranks, 151,936-token vocabulary, 600-token prompt", big, two,
                          [("pipeline even", 1, "even", None),
                           ("pipeline balanced, --workload batch", 1, "balanced", "batch")],
                          ("prefill",), runs, facts))
    return cases


def namespace_cases(tmp: Path, runs: int, calibration: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The namespace hosts' cases, and the added delay as the links job measured it."""
    from fixtures.cluster import ClusterUnavailable, built_cluster, check_available
    from mlxpipe.launch.links_job import measure

    try:
        check_available()
    except ClusterUnavailable as e:
        print(f"  namespace hosts skipped: {e}", file=sys.stderr)
        return [], None
    model = build_qwen2(tmp / "qwen2-8-ns", LAYERS)
    cases = []
    with locked("/tmp/mlxpipe-cluster.lock"), built_cluster(2) as cluster:
        os.environ["PATH"] = cluster.path_env()
        hostfile = cluster.hostfile(2, backend="ring", model_dir=lambda h: h.dir / "models")
        veths = [cluster.host(1).veth]
        for ms in (0.0, ADDED_MS):
            with added_latency(cluster.bridge, veths, ms):
                facts = links_facts(hostfile, calibration)
                cases.append(run_case(f"2 namespace hosts, +{ms:g} ms each way", model, hostfile,
                                      [("pipeline", 1, None, None), ("--tp 2", 2, None, None)], FIGURES, runs,
                                      facts, after_each=cluster.kill_leftovers))
        # The delay itself: both through the wire (the 0 ms case above ran without it), so only the delay differs.
        latency = {}
        for ms in (0.0, ADDED_MS):
            with added_latency(cluster.bridge, veths, ms, spliced_at_zero=True):
                latency[ms] = min(measure(hostfile, rounds=50, save=False).links[0].latency for _ in range(2))
            cluster.kill_leftovers()
    grown = (latency[ADDED_MS] - latency[0.0]) * 1e3
    wire = (f"the added delay, as the links job measures it (the least of two jobs' medians of 50 round trips, "
            f"both through the user-space wire): {latency[0.0] * 1e3:.3f} ms at 0 ms, "
            f"{latency[ADDED_MS] * 1e3:.3f} ms at {ADDED_MS:g} ms: predicted +{ADDED_MS:g} ms, measured "
            f"{grown:+.3f} ms ({grown / ADDED_MS:.2f}x)")
    return cases, wire


def print_case(case: dict[str, Any]) -> None:
    figures = case["figures"]
    print(f"\n### {case['title']}\n\n{case['links']}\n")
    print("| layout | split | " + " | ".join(f"{f} predicted | {f} measured (median) | error | {f} runs"
                                             for f in figures) + " |")
    print("|---|---|" + "---:|---:|---:|---|" * len(figures))
    for r in case["rows"]:
        cells = []
        for f in figures:
            pred, meas = r["figures"][f]["predicted"], r["figures"][f]["measured"]
            every = ", ".join(f"{x:.1f}" for x in r["figures"][f]["runs"] or ())
            cells.append(f"{pred:.1f} | {meas:.1f} | {100 * (pred - meas) / meas:+.0f}% | {every}")
        print(f"| {r['layout']} | {','.join(map(str, r['split']))} | {' | '.join(cells)} |")
    if len(case["rows"]) > 1:
        print()
        for f in figures:
            predicted = order(case["rows"], f, "predicted")
            measured = order(case["rows"], f, "measured")
            verdict = "agree" if predicted == measured else "**DIFFER**"
            print(f"- {f}, fastest first: predicted {' > '.join(predicted)}; measured {' > '.join(measured)}: "
                  f"{verdict}")


def order(rows: list[dict[str, Any]], figure: str, which: str) -> list[str]:
    """The layouts by ``figure`` (tok/s, higher first), as ``which`` (predicted or measured) has it."""
    return [r["layout"] for r in sorted(rows, key=lambda r: -r["figures"][figure][which])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per figure, no namespace hosts")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per figure (the median is shown)")
    parser.add_argument("--only", choices=("local", "namespace"), help="one group of cases")
    parser.add_argument("--json", type=Path, help="also write every figure and run here")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    groups = {"local"} if args.quick else {args.only} if args.only else {"local", "namespace"}
    started, load_before = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()
    wire = None
    with tempfile.TemporaryDirectory() as tmp_text, locked("/tmp/mlxpipe-ranks.lock"):
        tmp = Path(tmp_text)
        os.environ.setdefault("MLXPIPE_HOME", str(tmp / "home"))
        print("  calibrating this machine (a links job with --calibrate on 2 local ranks)...", file=sys.stderr)
        calibration = calibrate(local_hostfile(tmp, 2))
        cases = local_cases(tmp, runs, calibration) if "local" in groups else []
        if "namespace" in groups:
            more, wire = namespace_cases(tmp, runs, calibration)
            cases += more
    load_after = os.getloadavg()
    print(f"\n## Layouts: predicted against measured ({started})\n")
    print(f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, MLX on the CPU; load average (1, 5, 15 min) "
          f"{', '.join(f'{x:.1f}' for x in load_before)} before, {', '.join(f'{x:.1f}' for x in load_after)} after")
    print(f"- ranks: each worker pinned to a core of its own ({placement(2)}; the 1-host case: r0->c0); "
          "the namespace hosts' ssh sessions are not pinned")
    print(f"- figures: tok/s, the median of {runs} timed run{'s' if runs > 1 else ''} after a warm-up (the aggregate: "
          f"one batch after a warm-up one); decode: {DECODE_TOKENS} greedy tokens, one request; prefill: a "
          f"{PROMPT}-token prompt; aggregate: {CONCURRENCY} requests of {DECODE_TOKENS // 2} tokens at once, "
          f"decode batch {DECODE_BATCH}")
    print(f"- predictions: plan/estimate.py from each case's links job, the machine calibrated once: {calibration}")
    for case in cases:
        print_case(case)
    if wire is not None:
        print(f"\n### The delay wire\n\n{wire}")
    if args.json:
        args.json.write_text(json.dumps({"calibration": str(calibration), "cases": cases, "wire": wire,
                                         "load": [load_before, load_after]}, indent=2, default=str))


if __name__ == "__main__":
    main()
