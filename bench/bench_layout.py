"""The layout's cost model, predicted against measured, per layout (issue 31).

    python bench/bench_layout.py            # what `make bench` runs (about 20 minutes on 2 cores)
    python bench/bench_layout.py --quick    # one run per figure, no namespace hosts

For each case, every layout is started as `mlxpipe generate` starts it (`running_pipeline`), each rank
pinned to a core of its own, and timed: single-stream decode (tok/s of 64 generated tokens), the
prefill of a 600-token prompt (prompt tok/s), and the aggregate decode of 8 requests at once
(decode batch 4); each the median of --runs after a warm-up. Beside each figure, what
`plan/estimate.py` predicts from the facts the links job measured on the same hosts just before
(`doctor --links`; the machine's compute calibrated once, `--calibrate`, and reused).

Cases:

* 2 local ranks: a float32 qwen2 of 8 layers, hidden 512, as 1 host, a 2-stage pipeline and `--tp 2`;
  the issue's 12-layer model with a 151,936-token vocabulary (its head worth ~35 layers in bytes), the
  600-token prompt under the even split and under the split `--strategy balanced` gives for
  `--workload batch` (which weighs the head on every generated token);
* 2 namespace hosts (`tests/fixtures/cluster.py`, root only) with 0 and 5 ms added each way on one host's
  link (what `tc netem delay` would add; this machine's kernel has none, so `tests/fixtures/delay_wire.py`
  does it in user space): the 8-layer model as a pipeline and as `--tp 2`.

The measuring holds /tmp/mlxpipe-ranks.lock (and the cluster lock for the namespace hosts), so no other
ranks share the two cores meanwhile.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import REPO, cpu_name

sys.path.insert(0, str(REPO / "tests"))

from fixtures.layouts import (
    BIG_VOCABULARY,
    Measured,
    added_latency,
    build_qwen2,
    measure_layout,
    predict,
)

LAYERS = 8
PROMPT = 600
CONCURRENCY = 8
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
             figures: tuple[str, ...], runs: int, facts: Any) -> dict[str, Any]:
    rows = []
    for name, tp, strategy, workload in layouts:
        print(f"  {title}: {name}...", file=sys.stderr, flush=True)
        m = measure_layout(model, hostfile, tp=tp, strategy=strategy, workload=workload, pin=True, figures=figures,
                           runs=runs, prompt=PROMPT, concurrency=CONCURRENCY)
        p = predict(model, hostfile, m.split, tp=tp, strategy=strategy or "even", prompt=PROMPT,
                    concurrency=CONCURRENCY, facts=facts)
        rows.append(row(name, m, p, figures))
    return {"title": title, "rows": rows, "figures": figures}


def measure_facts(hostfile: Path, calibration: Any = None) -> Any:
    """The links job on ``hostfile`` (calibrating the machine unless ``calibration`` is given), written beside it."""
    from mlxpipe.cluster.links import measure, write_facts

    facts = measure(hostfile, calibrate=calibration is None)
    if calibration is not None:
        facts = facts.with_calibration(calibration)
        write_facts(facts, hostfile)
    return facts


def one_host_facts(facts: Any, hostfile: Path) -> Any:
    """The facts of the first host alone (no link), for the 1-host hostfile of the same machine."""
    from dataclasses import replace

    from mlxpipe.cluster.links import write_facts

    single = replace(facts, hosts=facts.hosts[:1], links=(), collective=None, addresses=facts.addresses[:1])
    write_facts(single, hostfile)
    return single


def local_cases(tmp: Path, runs: int) -> tuple[list[dict[str, Any]], Any]:
    model = build_qwen2(tmp / "qwen2-8", LAYERS)
    two, one = local_hostfile(tmp, 2), local_hostfile(tmp, 1)
    facts = measure_facts(two)
    single = one_host_facts(facts, one)
    cases = [run_case("1 host", model, one, [("1 host", 1, None, None)], FIGURES, runs, single)]
    cases.append(run_case("2 local ranks", model, two, [("pipeline (balanced = even)", 1, None, None),
                                                         ("--tp 2", 2, None, None)], FIGURES, runs, facts))
    big = build_qwen2(tmp / "qwen2-12-vocab", 12, BIG_VOCABULARY)
    cases.append(run_case("2 local ranks, 151,936-token vocabulary, 600-token prompt", big, two,
                          [("pipeline even", 1, "even", None),
                           ("pipeline balanced, --workload batch", 1, "balanced", "batch")],
                          ("prefill",), runs, facts))
    return cases, facts.hosts[0].calibration


def namespace_cases(tmp: Path, runs: int, calibration: Any) -> list[dict[str, Any]]:
    from fixtures.cluster import ClusterUnavailable, built_cluster, check_available

    try:
        check_available()
    except ClusterUnavailable as e:
        print(f"  namespace hosts skipped: {e}", file=sys.stderr)
        return []
    model = build_qwen2(tmp / "qwen2-8-ns", LAYERS)
    cases = []
    with locked("/tmp/mlxpipe-cluster.lock"), built_cluster(2) as cluster:
        os.environ["PATH"] = cluster.path_env()
        hostfile = cluster.hostfile(2, backend="ring", model_dir=lambda h: h.dir / "models")
        for ms in (0, 5):
            with added_latency(cluster.bridge, [cluster.host(1).veth], ms):
                facts = measure_facts(hostfile, calibration)
                cases.append(run_case(f"2 namespace hosts, +{ms} ms each way", model, hostfile,
                                      [("pipeline", 1, None, None), ("--tp 2", 2, None, None)], FIGURES, runs, facts))
            cluster.kill_leftovers()
    return cases


def print_case(case: dict[str, Any]) -> None:
    figures = case["figures"]
    print(f"\n### {case['title']}\n")
    print("| layout | split | " + " | ".join(f"{f} predicted | {f} measured | error" for f in figures) + " |")
    print("|---|---|" + "---:|---:|---:|" * len(figures))
    for r in case["rows"]:
        cells = []
        for f in figures:
            pred, meas = r["figures"][f]["predicted"], r["figures"][f]["measured"]
            cells.append(f"{pred:.1f} | {meas:.1f} | {100 * (pred - meas) / meas:+.0f}%")
        print(f"| {r['layout']} | {','.join(map(str, r['split']))} | {' | '.join(cells)} |")
    if len(case["rows"]) > 1:
        for f in figures:
            best_p = max(case["rows"], key=lambda r: r["figures"][f]["predicted"])["layout"]
            best_m = max(case["rows"], key=lambda r: r["figures"][f]["measured"])["layout"]
            miss = "" if best_p == best_m else "  **MISS**"
            print(f"\n{f}: predicted best {best_p}, measured best {best_m}{miss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per figure, no namespace hosts")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per figure (the median is shown)")
    parser.add_argument("--json", type=Path, help="also write every figure and run here")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as tmp_text, locked("/tmp/mlxpipe-ranks.lock"):
        tmp = Path(tmp_text)
        os.environ.setdefault("MLXPIPE_HOME", str(tmp / "home"))
        cases, calibration = local_cases(tmp, runs)
        if not args.quick:
            cases += namespace_cases(tmp, runs, calibration)
    print(f"\n## Layouts: predicted against measured ({started}; {cpu_name()}, {os.cpu_count()} CPUs; "
          f"median of {runs}; the machine calibrated once: {calibration})")
    for case in cases:
        print_case(case)
    if args.json:
        args.json.write_text(json.dumps({"calibration": str(calibration), "cases": cases}, indent=2, default=str))


if __name__ == "__main__":
    main()
