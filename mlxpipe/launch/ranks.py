"""Starting and supervising the ranks through ``mlx.launch``.

``mlx.launch`` is run as a subprocess from an argument list (its public
interface), by ``launch/mlx_launch.py``, which only makes its I/O threads
sleep instead of spinning a core per rank. On its own it exits 0 when a rank
fails, leaves the other ranks hanging when one exits 0 early, reports a remote
rank killed by a signal only as ssh's status 255, and merges every rank's
output. So each rank runs under a small supervisor (``python -m
mlxpipe.launch.supervisor --lease S -- <worker args>``, ``launch/supervisor.py``)
that:

* tags everything its worker prints as events carrying the rank, so the
  controller keeps one log per rank (``rank-<r>.log`` in the run directory),
  and writes them as frames the controller puts back together however
  mlx.launch cuts and merges the ranks' output (``mlxpipe.launch.frames``);
* reports the worker's exit (``exited``: status, signal, whether it said
  ``bye``), also for a remote rank killed by a signal;
* sends ``alive`` every second, so the controller tells a silent host from a
  stuck rank;
* stops its worker when it hears no heartbeat from the controller for the
  lease, so a rank whose controller or network is gone does not run forever.

The controller side (``Ranks``) owns the process, its threads and the logs,
and feeds every event to a ``failures.FailureTracker``, which decides, as
torchrun does, when the run has failed and which failure is the root cause.
``stop()`` sends SIGTERM to mlx.launch's whole process group (local ranks, and
the ssh clients whose closed connections hang up the remote ranks), then
SIGKILL after a grace period (``launch/signals.py`` turns SIGINT, SIGTERM and
SIGHUP to the controller into an exception, so the ranks are stopped on the way
out). The command line it runs is ``launch/command.py``'s.

A run directory (``mlxpipe_home()/runs/<id>/``) keeps ``command.txt`` (the
exact mlx.launch command line), ``hostfile.json``, ``launch.log`` (what
mlx.launch itself printed) and ``rank-<r>.log`` (each rank's output and events).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from mlxpipe.errors import LaunchError, WireError
from mlxpipe.launch import frames
from mlxpipe.launch.command import LaunchSpec, launch_argv
from mlxpipe.launch.failures import FailureTracker, NodeExit
from mlxpipe.launch.supervisor import HEARTBEAT_LINE, HEARTBEAT_SECONDS, KILL_GRACE_SECONDS
from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Log, rank_of
from mlxpipe.protocol.message import Message, Wire, tag_of
from mlxpipe.protocol.messages import Exit

RUN_LOG = "launch.log"

NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed|completed)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")



class Ranks:
    """A running set of ranks: send requests, read events, stop them all."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.size = spec.hostfile.size
        self.argv = launch_argv(spec)
        self.tracker = FailureTracker(spec.hostfile, spec.lease)
        self._events: queue.Queue[Wire | None] = queue.Queue()
        self._proc: subprocess.Popen[bytes] | None = None
        self._logs: dict[int | None, IO[bytes]] = {}
        self._log_lock = threading.Lock()
        self._stdin_lock = threading.Lock()
        self._stopped = threading.Event()
        self._group_stopped = False
        self._threads: list[threading.Thread] = []

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        run_dir = self.spec.run_dir
        (run_dir / "hostfile.json").write_text(json.dumps(self.spec.hostfile.to_mlx_launch(), indent=2))
        (run_dir / "command.txt").write_text(shlex.join(self.argv) + "\n")
        self._logs[None] = open(run_dir / RUN_LOG, "ab", buffering=0)  # noqa: SIM115 - open for the run
        self.tracker.started_at = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stdin must be a pipe: mlx.launch crashes when it is closed, and it broadcasts it to the ranks.
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True,
        )
        readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                   for s in (self._proc.stdout, self._proc.stderr)]
        for t in readers:
            t.start()
        self._threads = readers
        threading.Thread(target=self._wait_end, daemon=True).start()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def send(self, message: Message) -> None:
        """To every rank (mlx.launch broadcasts its standard input)."""
        self._write(wire.encode(message))

    def events(self, timeout: float, busy: Callable[[], bool] | None = None) -> Iterator[Wire]:
        """Yield the workers' events, as they arrived (``Pipeline.events`` types them); raise ``LaunchError``
        (root cause first) on any failure.

        ``timeout`` is the watchdog: the longest time without progress (any event but
        the supervisors' ``alive``) before the run is ended. With ``busy``, the clock
        only runs while it says work is outstanding (an idle server makes no progress).
        """
        last_progress = time.monotonic()
        while True:
            if busy is not None and not busy():
                last_progress = time.monotonic()
            self.tracker.check_liveness(timeout, last_progress)
            if self.tracker.failures:
                raise self._fail()
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if event is None:  # mlx.launch ended
                self._on_launch_end()
                return
            if self._record(event):
                last_progress = time.monotonic()
                yield event

    def close(self, timeout: float = 30.0) -> None:
        """Ask every rank to exit cleanly; stop them if they do not."""
        if self._proc is None or self._proc.poll() is not None:
            self._stopped.set()
            return
        self.send(Exit())
        deadline = time.monotonic() + timeout
        try:
            for _ in self.events(timeout=max(1.0, timeout)):
                if len(self.tracker.finished) == self.size or time.monotonic() > deadline:
                    break
            self._proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop every rank: SIGTERM to mlx.launch's process group, SIGKILL after a grace period.

        The group holds mlx.launch, the local ranks and the ssh clients of the remote
        ones; a closed ssh connection hangs up (SIGHUP) the remote rank's terminal.
        """
        self._stopped.set()
        self.tracker.stopped = True
        proc = self._proc
        if proc is None or self._group_stopped:
            return
        self._group_stopped = True
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        # Whatever of the group outlived mlx.launch (a rank ignoring SIGTERM) goes now.
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    def rank_log(self, rank: int) -> Path:
        """Everything rank ``rank`` printed, and its supervisor's events."""
        return self.spec.run_dir / f"rank-{rank}.log"

    # --- reading mlx.launch's output ----------------------------------------------

    def _read(self, stream: IO[bytes]) -> None:
        demux = frames.Demux()  # mlx.launch cuts the ranks' lines and merges the pieces
        for raw in stream:
            for item in demux.feed(raw.decode(errors="replace")):
                self._take(item)
        for item in demux.close():
            self._take(item)

    def _take(self, item: frames.Item) -> None:
        """One event, or one line of mlx.launch's own output."""
        if isinstance(item, dict):
            try:
                kind, rank = tag_of(item), rank_of(item)
            except WireError:
                return  # no supervisor's event: a frame's payload that only looked like one
            # When it arrived, not when it is read: a chat may leave events queued for minutes.
            self.tracker.heard(rank, time.monotonic())
            self._log_event(rank, kind, item)
            self._events.put(item)
            return
        line = _ANSI.sub("", item)
        if line.strip() == HEARTBEAT_LINE:
            return  # a terminal's echo before mlx.launch turned it off
        self._log_line(None, line)
        m = NODE_EXIT.search(line)
        if line.strip() and not m:
            self.tracker.launcher_lines.append(line.strip())
        if m:
            code = None if m.group(2) is None else int(m.group(2))
            self._events.put(NodeExit(rank=int(m.group(1)), line=m.group(0), code=code).to_wire())

    def _wait_end(self) -> None:
        for t in self._threads:
            t.join()
        if self._proc is not None:
            self._proc.wait()
        self._events.put(None)

    def _log_event(self, rank: int, kind: str, event: Wire) -> None:
        if kind == Log.TAG:
            try:
                text = Log.from_wire(event).text
            except WireError:  # the tracker refuses it, where the events are read: this thread reads on
                text = json.dumps(event)
            self._log_line(rank, text)
        elif kind not in ("alive", "token"):
            self._log_line(rank, wire.EVENT_PREFIX + json.dumps(event))

    def _log_line(self, rank: int | None, line: str) -> None:
        with self._log_lock:
            log = self._logs.get(rank)
            if log is None:
                path = self.spec.run_dir / RUN_LOG if rank is None else self.rank_log(rank)
                log = self._logs[rank] = open(path, "ab", buffering=0)  # noqa: SIM115 - open for the run
            log.write(line.encode(errors="replace") + b"\n")

    def _write(self, data: bytes) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        with self._stdin_lock:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the ranks are gone; the event stream reports why

    def _heartbeat(self) -> None:
        # Only once every supervisor runs: a remote terminal echoes what arrives before
        # mlx.launch's script turns echo off, and mlx.launch reads its first line as a pid file.
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            if len(self.tracker.started) == self.size:
                self._write(f"{HEARTBEAT_LINE}\n".encode())

    # --- events -> the tracker -----------------------------------------------------

    def _record(self, event: Wire) -> bool:
        """Feed one event to the tracker; True for the workers' own events (progress)."""
        progress = self.tracker.record(event)
        if tag_of(event) == "started" and len(self.tracker.started) == self.size and self._proc is not None:
            lower_priority(self._proc.pid)
        return progress

    def _on_launch_end(self) -> None:
        """mlx.launch exited: fine if every rank said bye, else the ranks that did not failed."""
        self.tracker.on_launch_end()
        if self.tracker.failures:
            raise self._fail()

    def _fail(self) -> LaunchError:
        """Settle on the root cause, stop every rank, and build the error to raise."""
        if self.tracker.root_cause is None:
            self._settle()
            self.tracker.choose_root_cause()
        self.stop()
        return self.tracker.error(self.spec.run_dir)

    def _settle(self) -> None:
        """Collect what else fails within the grace window, unless the root cause is plain already."""
        deadline = self.tracker.grace_ends
        while time.monotonic() < deadline:
            try:
                if self.tracker.plain:  # only what has already arrived, for the hint
                    event = self._events.get_nowait()
                else:
                    event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if event is None:
                self._events.put(None)
                self.tracker.flush_node_exits()
                return
            self._record(event)


def lower_priority(pid: int) -> None:
    """Make mlx.launch (not its ranks) yield the CPU to the ranks.

    Its per-rank I/O threads select() on the rank's stdin, which is always
    writable, so unpatched they never block and take a core per rank from the
    ranks on the controller's host. ``launch/mlx_launch.py`` makes them sleep;
    this stays for an mlx whose launcher that patch does not recognise. The
    ranks already run, so renicing mlx.launch now leaves them be. Linux sets
    niceness per thread, hence every task.
    """
    tasks = Path(f"/proc/{pid}/task")
    ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            pass  # gone already, or not ours: only speed is at stake


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
