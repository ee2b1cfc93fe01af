"""OpenAI-compatible servers under load (issues 9, 25): mlxpipe serve against mlx_lm.server.

    python bench/bench_serve.py            # what `make bench` runs (a few minutes per server)
    python bench/bench_serve.py --quick    # smoke run: 4 requests of 8 tokens, concurrency 1 and 2
    python bench/bench_serve.py --servers mlx-lm-pipeline,mlxpipe --requests 16 --max-tokens 64
    python bench/bench_serve.py --no-pin   # every process unpinned, as a new user runs them

One checkpoint (a random float32 qwen2, 20 layers, hidden 768; qwen2 has mlx-lm's
own ``pipeline()`` and ``shard()``) behind five servers, started one after the other in one run:

* ``mlx-lm``: single-process ``python -m mlx_lm.server``, pinned to one core;
* ``mlx-lm-pipeline``: ``mlx_lm.server --pipeline`` through ``mlx.launch`` on 2 local ranks
  (rank 0 loads the last layers and serves HTTP; every rank runs the batch generator);
* ``mlx-lm-tp``: ``mlx_lm.server`` through ``mlx.launch`` on the same 2 ranks without
  ``--pipeline``: its tensor-parallel mode (``model.shard()``);
* ``mlxpipe``: ``mlxpipe serve`` on the same 2 local ranks, at its defaults;
* ``mlxpipe-b1``: the same with ``--decode-batch 1`` (one request per decode micro-batch).

Each server gets, per concurrency level (1, 2, 4, 8), the same number of streaming chat
completions (fixed prompts, greedy, max_tokens each), sent by that many clients in
closed loop (a client sends its next request when its last one ends). Measured on
the client: aggregate tok/s (all generated tokens / wall time of the level, from the
first request sent to the last stream closed), time to first token (request sent to
the first chunk carrying text) and errors. A short warm-up request comes first.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import QWEN2_LAYERS, REPO, build_qwen2, cores, pin, placement, rank_cores

CONCURRENCY = (1, 2, 4, 8)
RANKS = 2
GOAL_CONCURRENT = 2.0  # mlxpipe serve / mlx_lm.server's faster distributed mode, at concurrency 2 and 4
GOAL_LEVELS = (2, 4)
TOPICS = ["dragons", "rivers", "clocks", "bridges", "gardens", "comets", "harbours", "lanterns",
          "islands", "kites", "mirrors", "owls", "glaciers", "violins", "deserts", "lighthouses"]
SERVERS = ("mlx-lm", "mlx-lm-pipeline", "mlx-lm-tp", "mlxpipe", "mlxpipe-b1")
LABELS = {
    "mlx-lm": "mlx_lm.server, single process",
    "mlx-lm-pipeline": "mlx_lm.server --pipeline (mlx.launch)",
    "mlx-lm-tp": "mlx_lm.server tensor parallel (mlx.launch)",
    "mlxpipe": "mlxpipe serve (defaults)",
    "mlxpipe-b1": "mlxpipe serve --decode-batch 1",
}


class Skip(Exception):
    """A server that cannot be measured here; the message says why."""


# --- results -----------------------------------------------------------------------------


@dataclass
class Result:
    """One request as the client saw it."""

    tokens: int = 0
    prompt_tokens: int | None = None  # as the server counts them (usage), chat template included
    ttft: float | None = None  # seconds from sending to the first chunk with text
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Level:
    server: str
    placement: str
    concurrency: int
    results: list[Result]
    wall: float

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results if r.error is None)

    @property
    def errors(self) -> int:
        return sum(r.error is not None for r in self.results)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    def ttft(self, q: float) -> float | None:
        values = sorted(r.ttft for r in self.results if r.error is None and r.ttft is not None)
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


# --- the client ----------------------------------------------------------------------------


def prompt_for(level: int, i: int) -> str:
    """A fixed prompt, different from its start for every request of a run (so that no prompt cache hit
    crosses requests beyond the chat template's opening); short, as the byte-level tokenizer makes a
    token of every character and prefill costs about as much per token as decoding on this CPU."""
    return f"{level}.{i}: a poem on {TOPICS[i % len(TOPICS)]}."


def _client_kind() -> str:
    try:
        import openai  # noqa: F401
    except ImportError:
        return "http.client"
    return "openai"


def stream_openai(base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Result:
    client = _openai_client(base, timeout)
    result = Result()
    chunks = 0
    tic = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                result.tokens = chunk.usage.completion_tokens
                result.prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices or []:
                if choice.delta is not None and choice.delta.content:
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - tic
    except Exception as e:  # noqa: BLE001 - any failure is an error of this request
        result.error = f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - tic
    result.tokens = result.tokens or chunks
    if result.error is None and result.tokens == 0:
        result.error = "no tokens"
    return result


_local = threading.local()


def _openai_client(base: str, timeout: float) -> Any:
    """One client per thread and server (its connection pool kept across that thread's requests)."""
    from openai import OpenAI

    key = (base, timeout)
    if getattr(_local, "key", None) != key:
        kwargs: dict[str, Any] = {}
        with contextlib.suppress(ImportError):
            import httpx2  # what this openai release is built on; no proxy for 127.0.0.1

            kwargs["http_client"] = httpx2.Client(trust_env=False, timeout=timeout)
        _local.client = OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=timeout, **kwargs)
        _local.key = key
    return _local.client


def stream_http(base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Result:
    """The same request with the standard library: POST, then read the SSE ``data:`` lines."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    })
    result = Result()
    chunks = 0
    done = False
    tic = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read(300).decode(errors='replace')}")
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"server error event: {event['error']}")
            usage = event.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                result.tokens = usage["completion_tokens"]
                result.prompt_tokens = usage.get("prompt_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - tic
        if not done:
            raise RuntimeError("stream closed without data: [DONE]")
    except Exception as e:  # noqa: BLE001
        result.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    result.seconds = time.perf_counter() - tic
    result.tokens = result.tokens or chunks
    if result.error is None and result.tokens == 0:
        result.error = "no tokens"
    return result


def run_level(send: Callable[[str], Result], prompts: list[str], concurrency: int) -> tuple[list[Result], float]:
    """``prompts`` sent by ``concurrency`` closed-loop clients; their results and the wall time."""
    todo: queue.Queue[str] = queue.Queue()
    for p in prompts:
        todo.put(p)
    results: list[Result] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            r = send(p)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - tic


# --- the servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports after it on 127.0.0.1 (mlx.launch's ring ports)."""
    for _ in range(50):
        base = free_port()
        if base + count >= 65000:
            continue
        ok = True
        for p in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports for the ring")


def _proc_table() -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (proc / "stat").read_text()
                parents[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _proc_table().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class Server:
    """A server process (and its process group, its ranks) started for the bench and stopped after."""

    def __init__(self, name: str, argv: list[str], port: int, model_id: str, logdir: Path, ranks: int,
                 health_ready: Callable[[dict[str, Any]], bool]) -> None:
        self.name = name
        self.argv = argv
        self.port = port
        self.model_id = model_id
        self.log = logdir / f"{name}.log"
        self.ranks = ranks  # 0: one process
        self.health_ready = health_ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.pinned: dict[int, int] = {}  # pid -> core
        self.base = f"http://127.0.0.1:{port}"

    def start(self, env: dict[str, str]) -> None:
        with open(self.log, "wb") as log:
            # stdin a pipe kept open: mlx.launch crashes when its stdin is closed.
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO, start_new_session=True)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            conn.close()

    def wait_ready(self, timeout: float) -> None:
        """Until /health says ready (raises Skip if the server exits or takes longer)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Skip(f"exited with code {self.proc.returncode} before it was ready:\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, body = self.get("/health")
                last = f"HTTP {status} {body[:200]}"
                with contextlib.suppress(ValueError):
                    health = json.loads(body)
                    if status == 200 and isinstance(health, dict) and self.health_ready(health):
                        return
                    if isinstance(health, dict) and health.get("status") == "failed":
                        raise Skip(f"/health says failed: {body[:300]}")
            time.sleep(0.5)
        raise Skip(f"not ready after {timeout:.0f} s (last /health: {last}):\n{self.tail()}")

    def pin(self, placement: list[int]) -> None:
        """Pin every thread of each rank's processes to that rank's core (the one process: to core 0)."""
        assert self.proc is not None
        for pid in descendants(self.proc.pid):
            env = _environ(pid)
            if self.ranks == 0:
                if pid == self.proc.pid:
                    pin(pid, placement[0])
                    self.pinned[pid] = placement[0]
            elif "MLX_RANK" in env and int(env["MLX_RANK"]) < len(placement):
                core = placement[int(env["MLX_RANK"])]
                pin(pid, core)
                self.pinned[pid] = core

    def renice(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, int(task.name), 19)

    def stop(self, grace: float = 10.0) -> list[int]:
        """SIGTERM to the server's process group, SIGKILL to whatever of it and below it is left.

        Returns the pids that had to be killed (still there after ``grace``).
        """
        if self.proc is None:
            return []
        below = descendants(self.proc.pid)  # ranks may run in process groups of their own
        groups = {self.proc.pid}
        for pid in below:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        left = [pid for pid in below if _alive(pid)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [pid for pid in left if _alive(pid)]
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None
        return left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def mlx_lm_server(model: Path, logdir: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    return Server("mlx-lm", argv, port, str(model), logdir, 0, lambda h: h.get("status") == "ok")


def mlx_lm_launched_server(model: Path, logdir: Path, pipeline: bool) -> Server:
    """``mlx_lm.server`` through mlx.launch on 2 local ranks: ``--pipeline``, else its tensor-parallel mode.

    Every rank runs the same command line; only rank 0 starts the HTTP server (on --port),
    the others run just the generation loop, which gets each request from rank 0 through
    an all_sum of its pickled bytes.
    """
    port = free_port()
    launch = Path(sys.executable).parent / "mlx.launch"
    if not launch.exists():
        found = shutil.which("mlx.launch")
        if not found:
            raise Skip("mlx.launch not found beside this interpreter or on PATH")
        launch = Path(found)
    hostfile = REPO / "hostfiles" / f"local-{RANKS}.json"
    argv = [str(launch), "--hostfile", str(hostfile), "--backend", "ring", "--starting-port", str(free_ports(RANKS)),
            "--", sys.executable, "-m", "mlx_lm", "server", *(["--pipeline"] if pipeline else []),
            "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    name = "mlx-lm-pipeline" if pipeline else "mlx-lm-tp"
    return Server(name, argv, port, str(model), logdir, RANKS, lambda h: h.get("status") == "ok")


def mlxpipe_server(model: Path, logdir: Path, max_concurrency: int, decode_batch: int | None = None) -> Server:
    help_run = subprocess.run([sys.executable, "-m", "mlxpipe", "serve", "--help"], capture_output=True, text=True,
                              cwd=REPO, env=_env(), timeout=120)
    if help_run.returncode != 0:
        listed = subprocess.run([sys.executable, "-m", "mlxpipe", "--help"], capture_output=True, text=True,
                                cwd=REPO, env=_env(), timeout=120).stdout
        if " serve " not in listed:
            raise Skip("this checkout's `mlxpipe --help` lists no `serve` command (issue 9 not merged yet)")
        raise Skip(f"`mlxpipe serve --help` failed (code {help_run.returncode}): {help_run.stderr.strip()[-300:]}")
    port = free_port()
    hostfile = REPO / "hostfiles" / f"local-{RANKS}.json"
    argv = [sys.executable, "-m", "mlxpipe", "serve", "--model", str(model), "--hostfile", str(hostfile),
            "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", str(max_concurrency)]
    if decode_batch is not None:
        argv += ["--decode-batch", str(decode_batch)]
    name = "mlxpipe" if decode_batch is None else f"mlxpipe-b{decode_batch}"
    return Server(name, argv, port, str(model), logdir, RANKS, lambda h: h.get("status") == "ready")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The servers run this checkout's mlxpipe, whatever the venv was installed from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- one server, every level ---------------------------------------------------------------


def placement_text(server: Server, pin_ranks: bool) -> str:
    if not pin_ranks:
        return "unpinned"
    return placement(server.ranks)


def measure(server: Server, args: argparse.Namespace, send_kind: str) -> list[Level]:
    print(f"starting {LABELS[server.name]} on 127.0.0.1:{server.port} ...", file=sys.stderr, flush=True)
    server.start(_env())
    tic = time.perf_counter()
    server.wait_ready(args.ready_timeout)
    stream = stream_openai if send_kind == "openai" else stream_http

    def send(prompt: str, max_tokens: int = args.max_tokens) -> Result:
        return stream(server.base, server.model_id, prompt, max_tokens, args.request_timeout)

    # mlx_lm.server answers /health before its model is loaded: the warm-up request waits for it.
    warm = send("Warm-up: say something.", 4)
    if warm.error:
        raise Skip(f"the warm-up request failed: {warm.error}\n{server.tail()}")
    print(f"  ready and warm after {time.perf_counter() - tic:.1f} s", file=sys.stderr, flush=True)
    if args.pin:
        server.pin(rank_cores(server.ranks) if server.ranks else [cores()[0]])
        if server.name.startswith("mlx-lm-") and server.proc is not None:
            server.renice([server.proc.pid])  # mlx.launch, as mlxpipe renices its own
    levels = []
    for c in args.concurrency:
        prompts = [prompt_for(c, i) for i in range(args.requests)]
        results, wall = run_level(send, prompts, c)
        level = Level(server.name, placement_text(server, args.pin), c, results, wall)
        levels.append(level)
        p50 = level.ttft(0.5)
        print(f"  concurrency {c}: {level.tokens} tokens in {wall:.1f} s = {level.tps:.2f} tok/s, "
              f"TTFT p50 {_s(p50)} s, errors {level.errors}", file=sys.stderr, flush=True)
        for r in results:
            if r.error:
                print(f"    error: {r.error[:300]}", file=sys.stderr, flush=True)
    return levels


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# --- output --------------------------------------------------------------------------------


def table(levels: list[Level]) -> str:
    lines = [
        "| server | ranks | placement (rank->core) | concurrency | requests | tokens | seconds | aggregate tok/s "
        "| TTFT p50 s | TTFT p90 s | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        ranks = 1 if lv.server == "mlx-lm" else RANKS
        lines.append(
            f"| {LABELS[lv.server]} | {ranks} | {lv.placement} | {lv.concurrency} | {len(lv.results)} | {lv.tokens} "
            f"| {lv.wall:.1f} | {lv.tps:.2f} | {_s(lv.ttft(0.5))} | {_s(lv.ttft(0.9))} | {lv.errors} |"
        )
    return "\n".join(lines)


def ratios(levels: list[Level]) -> str:
    by = {(lv.server, lv.concurrency): lv for lv in levels}
    pairs = [("mlxpipe", "mlxpipe-b1"), ("mlxpipe", "mlx-lm-pipeline"), ("mlxpipe", "mlx-lm-tp"), ("mlxpipe", "mlx-lm"),
             ("mlx-lm-pipeline", "mlx-lm"), ("mlx-lm-tp", "mlx-lm")]
    concurrency = sorted({lv.concurrency for lv in levels})
    lines = ["| ratio | " + " | ".join(f"concurrency {c}: tok/s, TTFT p50" for c in concurrency) + " |",
             "|---|" + "---:|" * len(concurrency)]
    shown = False
    for a, b in pairs:
        cells = []
        for c in concurrency:
            x, y = by.get((a, c)), by.get((b, c))
            if x is None or y is None or y.tps == 0:
                cells.append("-")
                continue
            t_x, t_y = x.ttft(0.5), y.ttft(0.5)
            ttft = f"{t_x / t_y:.2f}x" if t_x and t_y else "-"
            cells.append(f"{x.tps / y.tps:.2f}x, {ttft}")
        if any(cell != "-" for cell in cells):
            shown = True
            lines.append(f"| {LABELS[a]} / {LABELS[b]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if shown else ""


def verdict(levels: list[Level]) -> str:
    """Issue 25's goals at concurrency 2 and 4: mlxpipe at its defaults no slower than with --decode-batch 1,
    and at least GOAL_CONCURRENT x mlx_lm.server's faster distributed mode."""
    by = {(lv.server, lv.concurrency): lv for lv in levels}
    parts = []
    for c in GOAL_LEVELS:
        ours, b1 = by.get(("mlxpipe", c)), by.get(("mlxpipe-b1", c))
        theirs = [lv for lv in (by.get(("mlx-lm-pipeline", c)), by.get(("mlx-lm-tp", c))) if lv is not None and lv.tps]
        if ours is None:
            continue
        if b1 is not None and b1.tps:
            r = ours.tps / b1.tps
            parts.append(f"concurrency {c}: {r:.2f}x --decode-batch 1 (goal >= 1x, {'met' if r >= 1 else 'NOT met'})")
        if theirs:
            best = max(theirs, key=lambda lv: lv.tps)
            r = ours.tps / best.tps
            parts.append(f"concurrency {c}: {r:.2f}x {LABELS[best.server]} (goal >= {GOAL_CONCURRENT:g}x, "
                         f"{'met' if r >= GOAL_CONCURRENT else 'NOT met'})")
    if not parts:
        return ""
    return "Goals (issue 25), mlxpipe serve at its defaults, aggregate tok/s: " + "; ".join(parts) + "."


def notes(args: argparse.Namespace, client: str, levels: list[Level], skipped: dict[str, str]) -> str:
    counts = sorted({r.prompt_tokens for lv in levels for r in lv.results if r.prompt_tokens})
    prompt = f" ({counts[0]}-{counts[-1]} prompt tokens each, chat template included)" if counts else ""
    lines = [
        f"- Model: random float32 qwen2, {QWEN2_LAYERS} layers, hidden 768 (mlx-lm's own `pipeline()`), the same "
        f"checkpoint for every server. {args.requests} streaming chat completions per concurrency level, greedy "
        f"(temperature 0), max_tokens {args.max_tokens}, fixed one-line prompts{prompt}, the chat template applied by "
        "the server; a different prompt for every request of the run so that no prompt-cache hit crosses levels; "
        "sent by K closed-loop clients (K = concurrency) with the "
        f"{'`openai` package' if client == 'openai' else 'standard library (http.client)'}, "
        "stream_options.include_usage for the token count.",
        "- Aggregate tok/s = generated tokens of every request of the level / wall time of the level (first request "
        "sent to last stream closed, prefill included). TTFT = request sent to the first chunk carrying text, taken "
        "by the client (a byte-level random model may need a few tokens before it has text to send). "
        "One warm-up request (4 tokens) per server before the levels; servers run one at a time.",
    ]
    if args.pin:
        lines.append(
            f"- Placement: the single-process server pinned to core {cores()[0]} (every thread); each rank of the "
            "distributed servers (every process with that MLX_RANK under the server, every thread) pinned to its own "
            "core once the server answered its warm-up request. mlx.launch reniced to 19 for mlx_lm.server's "
            "distributed modes (mlxpipe renices its own); mlxpipe serve's controller process (its HTTP server) is left "
            "unpinned, mlx_lm.server's HTTP server runs inside rank 0. MLX's ring backend busy-waits: a waiting rank "
            "burns its core, and an idle mlx_lm.server --pipeline keeps both ranks busy polling for requests."
        )
    else:
        lines.append("- Placement: nothing pinned (--no-pin), as a new user would run them.")
    if len(cores()) < 3:
        lines.append(f"- {len(cores())} usable cores on this machine: client, HTTP servers and ranks share them; "
                     "the figures are for ratios between setups measured in one run, not absolute speed.")
    for name, why in skipped.items():
        lines.append(f"- Not measured: {LABELS[name]}: {why.splitlines()[0]}")
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run like Ctrl-C, so every server is still stopped."""

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 requests of 8 tokens at concurrency 1 and 2 (smoke run)")
    parser.add_argument("--requests", type=int, default=8, help="requests per concurrency level (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=list(CONCURRENCY),
                        help="comma-separated concurrency levels (default 1,2,4,8)")
    parser.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)} (default: all)")
    parser.add_argument("--model", type=Path, help="an existing checkpoint instead of the random qwen2 built here")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave every process unpinned")
    parser.add_argument("--client", choices=["auto", "openai", "http.client"], default="auto")
    parser.add_argument("--logs", type=Path, help="keep every server's output in this folder (default: dropped)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for a server to come up")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.concurrency = 4, 8, [1, 2]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))} (known: {', '.join(SERVERS)})")
    client = _client_kind() if args.client == "auto" else args.client
    if client == "openai" and _client_kind() != "openai":
        parser.error("--client openai: the openai package is not installed (pip install openai)")

    levels: list[Level] = []
    skipped: dict[str, str] = {}
    with signals_as_interrupts(), tempfile.TemporaryDirectory(prefix="mlxpipe-bench-serve-") as tmp:
        os.environ.setdefault("MLXPIPE_HOME", str(Path(tmp) / "home"))
        logdir = args.logs or Path(tmp) / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        if args.model:
            model = args.model.resolve()
        else:
            print("building the random qwen2 checkpoint...", file=sys.stderr, flush=True)
            model = build_qwen2(Path(tmp) / "qwen2-bench")
        for name in SERVERS:
            if name not in args.servers:
                continue
            server = None
            try:
                if name == "mlx-lm":
                    server = mlx_lm_server(model, logdir)
                elif name in ("mlx-lm-pipeline", "mlx-lm-tp"):
                    server = mlx_lm_launched_server(model, logdir, pipeline=name == "mlx-lm-pipeline")
                else:
                    server = mlxpipe_server(model, logdir, max(args.concurrency), 1 if name == "mlxpipe-b1" else None)
                levels += measure(server, args, client)
            except Skip as e:
                skipped[name] = str(e)
                print(f"skipping {LABELS[name]}: {e}", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    left = server.stop()
                    if left:
                        print(f"  {LABELS[name]}: {len(left)} process(es) ignored SIGTERM and were killed",
                              file=sys.stderr, flush=True)
    if not levels:
        print("No server measured.", file=sys.stderr)
        sys.exit(1)
    print(table(levels))
    text = ratios(levels)
    if text:
        print()
        print(text)
    text = verdict(levels)
    if text:
        print()
        print(text)
    print()
    print(notes(args, client, levels, skipped))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted; every server started here was stopped", file=sys.stderr)
        sys.exit(130)
