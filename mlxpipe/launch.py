"""Starting and supervising the ranks through ``mlx.launch``.

``mlx.launch`` is run as a subprocess from an argument list (its public
interface). It exits 0 even when a rank fails and leaves the other ranks
running when one exits 0 early, so success is judged from the ranks' own
events: every rank must say ``bye``. The first failure (a rank's ``error``
event, or mlx.launch reporting a rank's exit) is the root cause; then every
rank is stopped.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from mlxpipe import protocol, remote
from mlxpipe.errors import LaunchError
from mlxpipe.hostfile import Hostfile
from mlxpipe.paths import mlxpipe_home

DEFAULT_PORT = 32323
KILL_GRACE_SECONDS = 3.0
_NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed|completed)")
# mlx.launch logs a rank's exit on stderr up to ~0.1 s before it forwards that rank's last output.
_EXIT_GRACE_SECONDS = 1.5


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start the ranks."""

    hostfile: Hostfile
    worker_args: tuple[str, ...]  # after the interpreter: ("-m", "mlxpipe.worker", ...)
    backend: str = "ring"
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    run_dir: Path = field(default_factory=lambda: new_run_dir())


def new_run_dir() -> Path:
    """A fresh directory for this run's hostfile, command and logs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = mlxpipe_home() / "runs" / f"{stamp}-{os.getpid()}-{threading.get_ident() % 10000}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def mlx_launch_executable() -> str:
    """``mlx.launch`` beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    if beside.exists():
        return str(beside)
    found = shutil.which("mlx.launch")
    if not found:
        raise LaunchError("mlx.launch not found", "install mlx (pip install mlx) in this environment")
    return found


def launch_argv(spec: LaunchSpec) -> list[str]:
    """The exact ``mlx.launch`` command line for ``spec`` (also written to the run dir)."""
    hostfile_path = spec.run_dir / "hostfile.json"
    # --verbose makes mlx.launch report ranks that exit 0, which it otherwise ignores.
    argv = [mlx_launch_executable(), "--verbose", "--hostfile", str(hostfile_path), "--backend", spec.backend]
    for key, value in spec.env:
        argv += ["--env", f"{key}={value}"]
    argv += ["--starting-port", str(spec.port or default_port(spec.hostfile))]
    return argv + ["--", *rank_command(spec)]


def rank_command(spec: LaunchSpec) -> list[str]:
    """The command every rank runs; per-host interpreters are chosen by ``$MLX_RANK``."""
    pythons = [remote.python_for(h) for h in spec.hostfile.hosts]
    if len(set(pythons)) == 1:
        return [pythons[0], *spec.worker_args]
    cases = " ".join(f'{r}) exec {shlex.quote(p)} "$@";;' for r, p in enumerate(pythons))
    return ["/bin/sh", "-c", f'case "$MLX_RANK" in {cases} esac; exit 127', "mlxpipe-rank", *spec.worker_args]


def default_port(hostfile: Hostfile) -> int:
    """mlx.launch's port on real clusters; a free one when every rank is on this machine."""
    if all(h.is_local for h in hostfile.hosts):
        return free_port_base(sum(max(1, len(h.ips)) for h in hostfile.hosts))
    return DEFAULT_PORT


def free_port_base(count: int) -> int:
    """A base port with ``count`` free ports after it (for ranks on this machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_port_free(base + i) for i in range(count)):
            return base
    return DEFAULT_PORT


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class RankFailure:
    """The first thing that went wrong, for the root-cause line."""

    rank: int | None
    host: str | None
    what: str
    detail: str | None = None


class Ranks:
    """A running set of ranks: send requests, read events, stop them all."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.size = spec.hostfile.size
        self.argv = launch_argv(spec)
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._exits: dict[int, str] = {}
        self._finished: set[int] = set()
        self.failure: RankFailure | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None
        self._threads: list[threading.Thread] = []

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        run_dir = self.spec.run_dir
        (run_dir / "hostfile.json").write_text(json.dumps(self.spec.hostfile.to_mlx_launch(), indent=2))
        (run_dir / "command.txt").write_text(shlex.join(self.argv) + "\n")
        self._log = open(run_dir / "launch.log", "ab", buffering=0)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stdin must be a pipe: mlx.launch crashes when it is closed, and it broadcasts it to the ranks.
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True,
        )
        for target, stream in ((self._read_stdout, self._proc.stdout), (self._read_stderr, self._proc.stderr)):
            t = threading.Thread(target=target, args=(stream,), daemon=True)
            t.start()
            self._threads.append(t)

    def send(self, request: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(protocol.encode_request(request))
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the ranks are gone; the event stream reports why

    def events(self, timeout: float) -> Iterator[dict[str, Any]]:
        """Yield events; raise ``LaunchError`` (root cause first) on any failure.

        ``timeout`` is the watchdog: the longest silence tolerated between events.
        """
        exited: dict[int, float] = {}  # rank -> when it must have said bye
        last = time.monotonic()
        while True:
            now = time.monotonic()
            for rank, deadline in exited.items():
                if rank not in self._finished and now > deadline:
                    self._fail(RankFailure(rank, self._host(rank), self._exits[rank]))
                    self.stop()
                    raise self._error()
            if now - last > timeout:
                self._fail(RankFailure(None, None, f"no progress from any rank for {timeout:.0f} s",
                                       "a host may have stopped answering (mlx's ring has no receive timeout)"))
                self.stop()
                raise self._error()
            try:
                event = self._events.get(timeout=0.25)
            except queue.Empty:
                continue
            if event is None:  # mlx.launch ended
                self._on_launch_end()
                return
            kind = event.get("event")
            if kind == "_exit":
                exited[event["rank"]] = time.monotonic() + _EXIT_GRACE_SECONDS
                continue
            last = time.monotonic()
            if kind == "error":
                rank = event.get("rank")
                self._fail(RankFailure(rank, self._host(rank) or event.get("host"),
                                       f"{event.get('type', 'error')}: {event.get('message')}", event.get("traceback")))
                self.stop()
                raise self._error()
            if kind == "bye":
                self._finished.add(int(event.get("rank", -1)))
            yield event

    def _host(self, rank: int | None) -> str | None:
        if rank is None or not 0 <= rank < self.size:
            return None
        return self.spec.hostfile.hosts[rank].ssh

    def close(self, timeout: float = 30.0) -> None:
        """Ask every rank to exit cleanly; stop them if they do not."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self.send({"type": "exit"})
        deadline = time.monotonic() + timeout
        for _ in self.events(timeout=max(1.0, timeout)):
            if len(self._finished) == self.size or time.monotonic() > deadline:
                break
        try:
            self._proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()

    def stop(self) -> None:
        """Stop every rank: SIGTERM to the whole process group, SIGKILL after a grace period."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=KILL_GRACE_SECONDS)
                return
            except subprocess.TimeoutExpired:
                continue

    @property
    def log_path(self) -> Path:
        return self.spec.run_dir / "launch.log"

    # --- internals ---------------------------------------------------------------

    def _read_stdout(self, stream: Any) -> None:
        for raw in stream:
            if self._log:
                self._log.write(raw)
            event = protocol.parse_event(raw.decode(errors="replace"))
            if event is not None:
                self._events.put(event)
        if self._proc is not None:
            self._proc.wait()
        for t in self._threads[1:]:
            t.join(timeout=2)
        self._events.put(None)

    def _read_stderr(self, stream: Any) -> None:
        for raw in stream:
            if self._log:
                self._log.write(raw)
            line = raw.decode(errors="replace")
            m = _NODE_EXIT.search(line)
            if m:
                rank = int(m.group(1))
                if "killed" in m.group(0):
                    how = "was killed"
                elif m.group(2) is not None and m.group(2) != "0":
                    how = f"exited with status {m.group(2)}" + _signal_name(int(m.group(2)))
                else:
                    how = "exited with status 0 before finishing (mlx.launch would leave the others running)"
                self._exits.setdefault(rank, how)
                self._events.put({"event": "_exit", "rank": rank})

    def _on_launch_end(self) -> None:
        missing = sorted(set(range(self.size)) - self._finished)
        if not missing or self.failure is not None and self.failure.rank is not None:
            if self.failure is not None:
                raise self._error()
            return
        failed = [r for r in missing if r in self._exits]
        rank = failed[0] if failed else missing[0]
        self._fail(RankFailure(rank, self._host(rank), self._exits.get(rank, "exited before finishing")))
        raise self._error()

    def _fail(self, failure: RankFailure) -> None:
        if self.failure is None:
            self.failure = failure

    def _error(self) -> LaunchError:
        f = self.failure
        assert f is not None
        where = f"rank {f.rank} on {f.host}" if f.rank is not None else "the pipeline"
        hint = f"full log: {self.log_path}"
        if f.detail and not f.detail.startswith("Traceback"):
            hint = f"{f.detail}; {hint}"
        return LaunchError(f"{where}: {f.what}", hint)


def _signal_name(code: int) -> str:
    """`` (SIGKILL)`` for a negative status, as Popen reports deaths by signal."""
    if code < 0:
        try:
            return f" ({signal.Signals(-code).name})"
        except ValueError:
            return ""
    if code > 128:
        try:
            return f" ({signal.Signals(code - 128).name})"
        except ValueError:
            return ""
    return ""
