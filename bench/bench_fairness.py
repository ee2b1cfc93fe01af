"""A decoding stream while another request's long prompt prefills (issue 39): ``mlxpipe serve --prefill-budget``.

    python bench/bench_fairness.py            # what `make bench` runs (about 8 minutes here)
    python bench/bench_fairness.py --prompt-tokens 600 --budgets 32,8,0

One checkpoint (a random float32 qwen2, 20 layers, hidden 768, a byte tokenizer: a character is a token) served on
2 local ranks (the 2-rank pipeline, unpinned: the 2 ranks share the machine's cores with this client), once per
``--prefill-budget`` (32, the default; 0: no bound, every chunk --prefill-step-size 128 tokens). For each server:

* **solo decode**: one streamed request alone; the time between its tokens (median);
* **solo prefill**: the long prompt alone (max_tokens 1): its time to the first token;
* **together**: a stream decodes; once it has 8 tokens the long prompt is sent; the stream's time between tokens
  while that prompt prefills (median and longest), and the prompt's time to its first token.

Figures are for ratios between the servers of one run, never absolutes (a 2-core CPU, not the Metal GPU the
product targets). The goal (issue 39): the stream's time between tokens during the prefill within 3x its solo
time, the prefill within 1.5x its solo time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import REPO, build_qwen2, cpu_name

READY_SECONDS = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``mlxpipe serve`` of ``model`` on 2 local ranks, with ``flags``."""

    def __init__(self, model: Path, flags: list[str], home: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HOME": str(home), "MLXPIPE_HOME": str(home / "mlxpipe")}
        self.log = open(home / "serve.log", "w")  # noqa: SIM115 - kept for the server's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxpipe", "serve", "--model", str(model), "--hostfile",
             str(REPO / "hostfiles" / "local-2.json"), "--port", str(self.port), "--max-concurrency", "2",
             "--prompt-cache-size", "0", "--prompt-cache-gb", "0", *flags],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + READY_SECONDS
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=5).json().get("status") == "ready":
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mlxpipe serve {' '.join(flags)} did not get ready: {home / 'serve.log'}")
            time.sleep(0.5)

    def stream(self, prompt: str, max_tokens: int, times: list[float], started: threading.Event | None = None,
               after: int = 0) -> None:
        """Stream a completion, appending each text chunk's arrival time to ``times`` (``started`` set once
        ``after`` of them came)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.monotonic())
                    if started is not None and len(times) == after:
                        started.set()

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=60)
        self.log.close()


def gaps(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """The times between tokens whose second token came in [start, end]."""
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]


def measure(server: Server, long_prompt: str, decode_tokens: int) -> dict[str, float]:
    short = "Once upon a time, "
    solo: list[float] = []
    server.stream(short, 48, solo)
    alone: list[float] = []
    sent = time.monotonic()
    server.stream(long_prompt, 1, alone)
    prefill_alone = alone[0] - sent
    stream_times: list[float] = []
    started = threading.Event()
    decoding = threading.Thread(target=server.stream, args=(short, decode_tokens, stream_times, started, 8))
    decoding.start()
    started.wait(timeout=300)
    long_times: list[float] = []
    sent = time.monotonic()
    server.stream(long_prompt, 1, long_times)
    first = long_times[0]
    decoding.join()
    during = gaps(stream_times, sent, first)
    return {"solo_itl": statistics.median(gaps(solo)), "itl": statistics.median(during) if during else float("nan"),
            "itl_max": max(during) if during else float("nan"), "prefill_alone": prefill_alone,
            "prefill": first - sent, "tokens_during": len(during)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=300, help="the long prompt's tokens (characters)")
    parser.add_argument("--budgets", default="32,0", help="--prefill-budget values, one server each")
    parser.add_argument("--decode-tokens", type=int, default=1000,
                        help="the decoding stream's max_tokens: it must outlast the long prompt's prefill")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    try:
        model = build_qwen2(work / "qwen2")
        long_prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[: args.prompt_tokens]
        rows = []
        for budget in args.budgets.split(","):
            home = work / f"home-{budget}"
            home.mkdir()
            server = Server(model, ["--prefill-budget", budget], home)
            try:
                rows.append((budget, measure(server, long_prompt, args.decode_tokens)))
            finally:
                server.stop()
        print(f"\nA decoding stream during a {args.prompt_tokens}-token prefill, mlxpipe serve on 2 local ranks "
              f"(qwen2 20 layers, hidden 768, float32; {cpu_name()}, unpinned)\n")
        print("| --prefill-budget | time between tokens: solo | during the prefill (median / longest) | ratio "
              "| prefill alone | prefill beside the stream | ratio |")
        print("|---|---|---|---|---|---|---|")
        for budget, r in rows:
            label = f"{budget} (no bound: chunks of 128)" if budget == "0" else budget
            print(f"| {label} | {r['solo_itl'] * 1000:.0f} ms | {r['itl'] * 1000:.0f} / {r['itl_max'] * 1000:.0f} ms "
                  f"({r['tokens_during']:.0f} tokens) | {r['itl'] / r['solo_itl']:.1f}x | {r['prefill_alone']:.2f} s "
                  f"| {r['prefill']:.2f} s | {r['prefill'] / r['prefill_alone']:.2f}x |")
        print("\nGoal (issue 39): the ratio of the time between tokens within 3x; of the prefill, within 1.5x. "
              "Ratios within this run only.")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
