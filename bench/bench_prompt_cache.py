"""The prompt cache's disk tier (issue 32): time to first token of an agent-like second turn after a restart.

    python bench/bench_prompt_cache.py            # what `make bench` runs (about 6 minutes here)
    python bench/bench_prompt_cache.py --quick    # smoke run: a 1k-token prefix, one repeat
    python bench/bench_prompt_cache.py --prefix 8192 --repeats 5

An agent resends a long prefix every turn (its system prompt and tool schemas, then the conversation). Here the
prefix is a system turn of ``--prefix`` tokens (instructions and JSON tool schemas as text: the byte-level
tokenizer makes a token of each byte). On a random float32 qwen2 (20 layers, hidden 768), ``mlxpipe serve`` on
2 local ranks, each pinned to a core of its own:

1. a server with the disk tier (its own directory) answers the first turn (the prefix and a first message),
   writes each rank's slice of its caches, and is stopped;
2. a second server on the same directory answers the second turn (the first turn, its reply, a new message):
   from disk. It runs without the memory tier (``--prompt-cache-size 0``) so that every repeat reads the disk
   (each repeat's new message differs), as the first turn after a restart does;
3. a third server without either tier (``--prompt-cache-gb 0 --prompt-cache-size 0``) answers the same second
   turn cold: what a restart costs without the disk tier.

TTFT is the client's: the request sent (a streaming chat completion, greedy) to the first chunk with text. The
ranks' own figures (``/health``) give the tier's costs: the snapshot a write takes on the rank's thread (the only
part that delays other requests), the write on the writer's thread, a load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from common import QWEN2_BENCH, QWEN2_LAYERS, REPO, build_qwen2, cores, cpu_name, pin, placement, rank_cores

RANKS = 2
MAX_TOKENS = 8
READY_SECONDS = 600.0
REQUEST_SECONDS = 1800.0
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace and "
        "return its text, with line numbers.", "parameters": {"type": "object", "properties": {"path": {
            "type": "string", "description": "The file's path, relative to the workspace."}}, "required": ["path"]}}}


def system_prompt(tokens: int) -> str:
    """An agent's system turn of about ``tokens`` bytes: instructions, then tool schemas (each named apart)."""
    text = ("You are a coding agent working in the user's repository. Read before you edit, keep changes small, "
            "run the tests you touch, and say what you changed. The tools you may call follow.\n")
    n = 0
    while len(text) < tokens:
        tool = json.loads(json.dumps(TOOL))
        tool["function"]["name"] = f"tool_{n}"
        text += json.dumps(tool) + "\n"
        n += 1
    return text[:tokens]


# --- one server ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _workers(home: Path) -> dict[int, int]:
    """rank -> pid of the ``mlxpipe.worker`` processes whose HOME is ``home`` (this bench's servers)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if argv[1:3] != ["-m", "mlxpipe.worker"]:
                continue
            env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in item)
            if env.get("HOME") == str(home) and "MLX_RANK" in env:
                found[int(env["MLX_RANK"])] = int(proc.name)
    return found


@contextlib.contextmanager
def server(model: Path, home: Path, cache_dir: Path, *flags: str) -> Iterator[str]:
    """``mlxpipe serve`` of ``model`` on 2 local ranks, each pinned to its core, ready; its base URL."""
    port = _free_port()
    env = {**os.environ, "HOME": str(home), "MLXPIPE_HOME": str(home / "mlxpipe"), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "mlxpipe", "serve", "--model", str(model), "--hostfile",
            str(REPO / "hostfiles" / f"local-{RANKS}.json"), "--port", str(port), "--prompt-cache-dir",
            str(cache_dir), *flags]
    log = home / f"serve-{port}.log"
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_SECONDS
        while _health(base).get("status") != "ready":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlxpipe serve did not get ready: see {log}")
            time.sleep(0.5)
        for rank, core in enumerate(rank_cores(RANKS)):
            pid = _workers(home).get(rank)
            if pid is not None:
                pin(pid, core)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _health(base: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{base}/health", timeout=5).json())
    except (httpx.HTTPError, ValueError):
        return {}


def turn(base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed greedy chat completion: its TTFT (client side), reply text and usage."""
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"ttft": None, "text": "", "usage": None}
    tic = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=REQUEST_SECONDS) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    out["ttft"] = out["ttft"] if out["ttft"] is not None else time.perf_counter() - tic
                    out["text"] += text
    return out


def wait_written(cache_dir: Path, count: int, timeout: float = 600.0) -> None:
    """Until every rank's folder holds ``count`` entries."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        folders = [f for f in cache_dir.iterdir() if f.is_dir()]
        if len(folders) == RANKS and all(len(list(f.glob("*.safetensors"))) >= count for f in folders):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the ranks did not write their slices to {cache_dir} in {timeout:g} s")


def tier_figures(base: str) -> list[dict[str, Any]]:
    return [r.get("prompt_cache") or {} for r in _health(base).get("ranks", [])]


# --- the run -------------------------------------------------------------------------------


def run(prefix: int, repeats: int, cold_repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-prompt-cache-") as tmp:
        root = Path(tmp)
        overrides = {**QWEN2_BENCH, "max_position_embeddings": 4 * prefix + 4096}
        model = build_qwen2(root / "model", overrides=overrides)
        home, cache_dir = root / "home", root / "prompt-cache"
        home.mkdir()
        first = [{"role": "system", "content": system_prompt(prefix)},
                 {"role": "user", "content": "Find where the config is parsed."}]
        results: dict[str, Any] = {"prefix": prefix}
        with server(model, home, cache_dir) as base:
            results["first"] = turn(base, first)
            wait_written(cache_dir, 1)
            turn(base, [{"role": "user", "content": "hi"}])  # too short to be kept: its end reports the write
            results["written"] = tier_figures(base)
        history = [*first, {"role": "assistant", "content": results["first"]["text"]}]

        def second(i: int) -> list[dict[str, str]]:
            return [*history, {"role": "user", "content": f"Now open the parser ({i}) and explain it."}]

        with server(model, home, cache_dir, "--prompt-cache-size", "0") as base:
            results["disk"] = [turn(base, second(i)) for i in range(repeats)]
            results["loaded"] = tier_figures(base)
        with server(model, home, cache_dir, "--prompt-cache-gb", "0", "--prompt-cache-size", "0") as base:
            results["cold"] = [turn(base, second(i)) for i in range(cold_repeats)]
        same = all(d["text"] == c["text"] for d, c in zip(results["disk"], results["cold"], strict=False))
        results["same_text"] = same
        results["entry_mb"] = [sum(p.stat().st_size for p in f.glob("*.safetensors")) / 1e6 / len(
            list(f.glob("*.safetensors"))) for f in sorted(cache_dir.iterdir()) if f.is_dir()]
        return results


def report(r: dict[str, Any], repeats: int, cold_repeats: int) -> None:
    cold = statistics.median(x["ttft"] for x in r["cold"])
    disk = statistics.median(x["ttft"] for x in r["disk"])
    usage = r["disk"][0]["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"| second turn after a restart ({usage['prompt_tokens']} prompt tokens) | TTFT | prefilled | vs cold |")
    print("|---|---:|---:|---:|")
    print(f"| cold: no disk tier (median of {cold_repeats}) | {cold:.2f} s | {usage['prompt_tokens']} | 1.00x |")
    print(f"| from the disk tier (median of {repeats}) | {disk:.2f} s | {usage['prompt_tokens'] - cached} "
          f"| {cold / disk:.1f}x |")
    written, loaded = r["written"], r["loaded"]
    snap = max(w["snapshot_s"] / max(w["writes"], 1) for w in written)
    write = max(w["write_s"] / max(w["writes"], 1) for w in written)
    load = max(x["load_s"] / max(x["loads"], 1) for x in loaded)
    print(f"\n- first turn cold: TTFT {r['first']['ttft']:.2f} s for {r['first']['usage']['prompt_tokens']} prompt "
          f"tokens; the second turn from disk read {cached} cached tokens; replies identical to the cold run's: "
          f"{r['same_text']}")
    print(f"- per rank and entry: {', '.join(f'{mb:.1f}' for mb in r['entry_mb'])} MB on disk; a write held the "
          f"rank's thread {snap * 1000:.1f} ms (the snapshot) and took {write * 1000:.0f} ms on the writer's "
          f"thread; a load took {load * 1000:.0f} ms (slowest rank)")
    print(f"- {cpu_name()}, {len(cores())} usable cores, {platform.system()} {platform.machine()}; ranks pinned "
          f"{placement(RANKS)}; random float32 qwen2, {QWEN2_LAYERS} layers, hidden {QWEN2_BENCH['hidden_size']}; "
          f"TTFT measured by the client, request sent to first text chunk, greedy, max_tokens {MAX_TOKENS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=4096, help="tokens of the agent's system turn")
    parser.add_argument("--repeats", type=int, default=3, help="second turns read from disk (each its own message)")
    parser.add_argument("--cold-repeats", type=int, default=1, help="second turns prefilled cold")
    parser.add_argument("--quick", action="store_true", help="a 1k-token prefix, one repeat of each")
    args = parser.parse_args()
    if args.quick:
        args.prefix, args.repeats, args.cold_repeats = 1024, 1, 1
    report(run(args.prefix, args.repeats, args.cold_repeats), args.repeats, args.cold_repeats)


if __name__ == "__main__":
    main()
