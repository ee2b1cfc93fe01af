"""The per-rank supervisor: ``python -m mlxpipe.launch.supervisor --lease S -- <worker args>``.

``mlx.launch`` starts this on every rank; it runs the rank's worker as a child
and speaks for it (see ``mlxpipe.launch.ranks`` for why):

* every line the worker prints becomes an event carrying the rank (plain lines
  as ``log`` events), so the controller keeps one log per rank; events go out
  as frames that survive mlx.launch cutting and merging the ranks' output
  (``mlxpipe.launch.frames``);
* ``started`` (pids), ``alive`` every second, and ``exited`` (status, signal,
  whether the worker said ``bye``) — also for a remote rank killed by a signal,
  which mlx.launch would see only as ssh's status 255;
* the worker is stopped when no heartbeat comes from the controller for the
  lease, so a rank whose controller or network is gone does not run forever;
* the worker is killed when it falls silent: it beats every second from a
  thread of its own (``protocol.wire.start_beating``), through long steps and
  waits on the ring, so ``WORKER_SILENCE_SECONDS`` without a word means a
  stopped (SIGSTOP), frozen or hung process. Its ``exited`` says ``silent``,
  and the controller names it as the root cause within seconds, where the
  watchdog on progress (``--timeout``) would wait for minutes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

from mlxpipe.errors import WireError
from mlxpipe.launch import frames
from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Alive, Bye, Error, Exited, Log, Started
from mlxpipe.protocol.message import Event, Wire, tag_of

if TYPE_CHECKING:
    from types import FrameType

KILL_GRACE_SECONDS = 3.0
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_LINE = "@@mlxpipe-heartbeat@@"
MAX_LEASE_SECONDS = 30.0
# The lease before the first heartbeat: longer, so the controller reports a rank
# that never started before the others give up on it.
STARTUP_LEASE_SECONDS = 60.0
# A worker that has beaten once and then says nothing for this long is stopped or hung (it beats every second).
WORKER_SILENCE_SECONDS = 5.0
_MAX_LINE = 2000  # characters of one log line per event
_POLL_SECONDS = 0.1


class _Supervisor:
    """Runs one rank's worker with this interpreter; see the module docstring."""

    child: subprocess.Popen[bytes]

    def __init__(self, worker_args: Sequence[str], lease: float, silence: float = WORKER_SILENCE_SECONDS) -> None:
        self.worker_args = list(worker_args)
        self.silence = silence
        self.rank = int(os.environ.get("MLX_RANK", "-1"))
        self.lease = lease
        self.started = time.monotonic()
        self.last_heartbeat: float | None = None
        self.last_word: float | None = None  # the worker's latest line (a beat, an event, any output)
        self.finished = False
        self.stop_reason: str | None = None
        # A signal to this supervisor (mlx.launch stopping the rank): why the worker was stopped, if it still ran.
        self.signalled: str | None = None
        self._wake = threading.Event()
        self._frames = frames.Writer(self.rank)

    def run(self) -> int:
        """Run the worker to its end (or stop it); return its exit status, 128 + N for signal N."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.child = subprocess.Popen(
            [sys.executable, *self.worker_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.emit(Started(rank=self.rank, pid=self.child.pid, supervisor=os.getpid()))
        pumps = [threading.Thread(target=self._pump, args=(s, n), daemon=True)
                 for s, n in ((self.child.stdout, "stdout"), (self.child.stderr, "stderr"))]
        for t in pumps:
            t.start()
        threading.Thread(target=self._read_stdin, daemon=True).start()
        last_alive = 0.0
        while self.child.poll() is None and self.stop_reason is None and self.signalled is None:
            if self._lease_expired():
                self.stop_reason = "lease"
                break
            if self._silent():
                self.stop_reason = "silent"
                self.child.kill()  # it answers no signal it could handle: a stopped process would keep SIGTERM
                break
            if time.monotonic() - last_alive >= HEARTBEAT_SECONDS:
                self.emit(Alive(rank=self.rank))
                last_alive = time.monotonic()
            self._wake.wait(_POLL_SECONDS)
        if self.child.poll() is None:
            # Only a worker still running is stopped by the signal. mlx.launch stops every rank once one has
            # failed, and a worker killed on its own can have ended before this loop saw it: its own exit is then
            # the root cause, and must not read as a consequence ("stopped by SIGTERM") of its peer's failure.
            self.stop_reason = self.stop_reason or self.signalled
            _terminate(self.child)
        code = self.child.wait()
        for t in pumps:
            t.join(timeout=2)
        self.emit(Exited(rank=self.rank, returncode=code, signal=_signal_name(code), stopped=self.stop_reason,
                         finished=self.finished))
        return 128 - code if code < 0 else code

    def emit(self, event: Event) -> None:
        """Write one event of the supervisor's own as frames that survive mlx.launch cutting them (see
        ``mlxpipe.launch.frames``)."""
        self._write(event.to_wire())

    def _write(self, data: Wire) -> None:
        try:
            self._frames.write(data)
        except OSError:
            pass  # the controller is gone (a hung-up terminal): nobody to tell

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name
        self._wake.set()

    def _lease_expired(self) -> bool:
        now = time.monotonic()
        if self.last_heartbeat is None:
            return now - self.started > max(self.lease, STARTUP_LEASE_SECONDS)
        return now - self.last_heartbeat > self.lease

    def _silent(self) -> bool:
        return self.last_word is not None and time.monotonic() - self.last_word > self.silence

    def _read_stdin(self) -> None:
        """Requests go on to the worker; heartbeats renew the lease."""
        assert self.child.stdin is not None
        for line in sys.stdin.buffer:
            if line.strip() == HEARTBEAT_LINE.encode():
                self.last_heartbeat = time.monotonic()
                continue
            try:
                self.child.stdin.write(line)
                self.child.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return
        try:
            self.child.stdin.close()
        except OSError:
            pass

    def _pump(self, stream: IO[bytes], name: str) -> None:
        """Forward the worker's events with its rank, and every other line as a ``log`` event.

        The events go on as they came, with the rank (the controller reads them, ``protocol.events``):
        only a ``bye`` is noted, and an ``error``'s traceback goes to the rank's log as lines of its own."""
        for raw in stream:
            self.last_word = time.monotonic()
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line == wire.WORKER_BEAT_LINE:
                continue
            data = wire.parse_event(line)
            try:
                kind = tag_of(data) if data is not None else None
            except WireError:
                kind = None
            if data is None or kind is None:
                for i in range(0, max(len(line), 1), _MAX_LINE):
                    self.emit(Log(rank=self.rank, stream=name, text=line[i : i + _MAX_LINE]))
                continue
            if kind == Bye.TAG:
                self.finished = True
            if kind == Error.TAG and "traceback" in data:  # the rank's log keeps it; the controller needs none
                for text in str(data.pop("traceback") or "").splitlines():
                    self.emit(Log(rank=self.rank, stream=name, text=text[:_MAX_LINE]))
            self._write({**data, "rank": self.rank})


def _terminate(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after the grace period."""
    child.terminate()
    try:
        child.wait(timeout=KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()


def _signal_name(code: int) -> str | None:
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the supervisor that ``mlx.launch`` starts on every rank."""
    parser = argparse.ArgumentParser(
        prog="python -m mlxpipe.launch.supervisor",
        description="Run one rank's worker under mlxpipe's supervisor (mlx.launch starts this on every rank).",
    )
    parser.add_argument("--lease", type=float, default=MAX_LEASE_SECONDS,
                        help="stop the worker after this many seconds without a heartbeat")
    parser.add_argument("--silence", type=float, default=WORKER_SILENCE_SECONDS,
                        help="kill the worker when it has said nothing for this many seconds, having said something")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then the worker's arguments")
    args = parser.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    if not worker_args:
        parser.error("no worker command after --")
    return _Supervisor(worker_args, args.lease, args.silence).run()


if __name__ == "__main__":
    # os._exit: the thread blocked reading stdin would make a normal exit abort (SIGABRT).
    os._exit(main())
