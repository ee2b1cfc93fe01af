"""The pause a client sees when a rank fails mid-stream (issue 38): ``kill -9`` and ``kill -STOP`` of rank 1.

    python bench/bench_resume.py              # what `make bench` runs (about 4 minutes here)
    python bench/bench_resume.py --repeats 3

One ``mlxpipe serve`` of a tiny float32 chat model (the demo's tokenizer and template on tiny weights, as the tests
build it) on 2 local ranks, ``--max-restarts`` high enough for every repeat. Each repeat streams one greedy chat
request; after 20 text chunks rank 1's worker gets the signal, and the client reads on to the end. Each stream
starts once the pipeline has served ``STABLE_SECONDS`` since its last relaunch, so each failure is a first one (a
failure soon after a relaunch waits longer before the next: ``serve.queue``'s backoff). Per signal, the median
over the repeats of:

* **pause**: the longest time between two text chunks of the stream (the failure's gap);
* **detected**: from the signal to the server's line saying a rank failed (its root cause named);
* **restarted**: from that line to the server's next ``ready`` line (the relaunch and the load);

and whether every stream's text equalled the undisturbed run's (sent first). Figures are for this machine only
(a 2-core CPU, unpinned), never absolutes: the product targets the Metal GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import REPO, cpu_name

READY_SECONDS = 300.0
MAX_TOKENS = 200
SIGNALS = {"kill -9": signal.SIGKILL, "kill -STOP": signal.SIGSTOP}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``mlxpipe serve`` of ``model`` on 2 local ranks; its output's lines with their arrival times."""

    def __init__(self, model: Path, restarts: int, home: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HOME": str(home), "MLXPIPE_HOME": str(home / "mlxpipe")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxpipe", "serve", "--model", str(model), "--hostfile",
             str(REPO / "hostfiles" / "local-2.json"), "--port", str(self.port), "--max-restarts", str(restarts)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_line("ready", 0, READY_SECONDS)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def wait_line(self, fragment: str, since: int, timeout: float = 120.0) -> float:
        """When the first line from ``since`` on holding ``fragment`` came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in self.lines[since:]:
                if fragment in line:
                    return when
            time.sleep(0.02)
        raise SystemExit(f"no line with {fragment!r} from mlxpipe serve:\n{''.join(x for _, x in self.lines)}")

    def worker(self, rank: int) -> int:
        """The pid of rank ``rank``'s worker (not its supervisor) among the server's processes."""
        from fixtures.processes import local_rank_processes

        for pid, (found, cmd) in local_rank_processes(self.proc.pid).items():
            if found == rank and "mlxpipe.launch.supervisor" not in cmd:
                return pid
        raise SystemExit(f"no worker of rank {rank} found")

    def stream(self, signal_after: int | None = None, sig: signal.Signals | None = None) -> tuple[str, list[float],
                                                                                                   float | None]:
        """A greedy chat stream's text and its chunks' arrival times; with ``sig``, sent to rank 1's worker once
        ``signal_after`` chunks came (its time returned)."""
        body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}
        texts, times, sent = [], [], None
        with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise SystemExit(f"the stream ended with an error: {chunk['error']}")
                text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if text:
                    texts.append(text)
                    times.append(time.monotonic())
                    if sig is not None and len(texts) == signal_after:
                        os.kill(self.worker(1), sig)
                        sent = time.monotonic()
        return "".join(texts), times, sent

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="streams per signal")
    args = parser.parse_args()
    from fixtures.demo_model import make_chat_model
    from mlxpipe.model.demo import DEMO_MODEL_NAME, build_demo_model
    from mlxpipe.serve.queue import STABLE_SECONDS

    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    try:
        model = make_chat_model(build_demo_model(work / DEMO_MODEL_NAME), work / "SmolLM2-tiny")
        home = work / "home"
        home.mkdir()
        server = Server(model, 2 * args.repeats * len(SIGNALS) + 1, home)
        ready_at = time.monotonic()
        try:
            undisturbed, _, _ = server.stream()
            rows = []
            for name, sig in SIGNALS.items():
                pauses, detected, restarted, equal = [], [], [], 0
                for _ in range(args.repeats):
                    time.sleep(max(0.0, ready_at + STABLE_SECONDS + 1 - time.monotonic()))
                    since = len(server.lines)
                    text, times, sent = server.stream(20, sig)
                    assert sent is not None
                    failed = server.wait_line("a rank failed", since)
                    ready = ready_at = server.wait_line("ready", since)
                    pauses.append(max(b - a for a, b in itertools.pairwise(times)))
                    detected.append(failed - sent)
                    restarted.append(ready - failed)
                    equal += text == undisturbed
                rows.append((name, statistics.median(pauses), statistics.median(detected),
                             statistics.median(restarted), equal))
        finally:
            server.stop()
        print(f"\nA rank failing mid-stream, mlxpipe serve on 2 local ranks (a tiny float32 chat model; "
              f"{cpu_name()}, unpinned; median of {args.repeats})\n")
        print("| rank 1's worker gets | the client's pause | detected | relaunched and loaded | text = undisturbed |")
        print("|---|---|---|---|---|")
        for name, pause, found, relaunch, equal in rows:
            print(f"| {name} | {pause:.1f} s | {found:.1f} s | {relaunch:.1f} s | {equal} of {args.repeats} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
