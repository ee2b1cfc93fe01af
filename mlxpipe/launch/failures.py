"""What went wrong in a run: each rank's state, the watchdogs' verdicts, the root cause.

``launch.Ranks`` owns the processes, threads and logs; it feeds every event it
reads to a ``FailureTracker`` and asks it, with the time, whether the run has
failed. The tracker does no I/O and reads no clock of its own (the clock is
passed in), so every verdict is testable from a list of events.

The rules follow torchrun: one failure stops every rank, and the root cause is
reported first (host, rank, exit status or exception). A killed rank is often
observed *after* the peers that noticed its death ("[ring] connection to a peer
was lost"), so failures are collected for a short grace window and one that is
not such a consequence is preferred.
"""

from __future__ import annotations

import collections
import math
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.errors import LaunchError
from mlxpipe.launch.supervisor import HEARTBEAT_SECONDS, WORKER_SILENCE_SECONDS
from mlxpipe.protocol.events import CONTROL, Bye, Error, Exited, Log, Lost, Progress, Started, rank_of
from mlxpipe.protocol.message import Event, Registry, Wire, tag_of

# Every rank's supervisor must say ``started`` within this; heartbeats begin once all have.
START_TIMEOUT_SECONDS = 45.0
# How long to keep collecting failures after the first, looking for the root cause; longer while every failure
# known is a consequence of another (a peer's lost connection): the rank that died says so through its supervisor
# and the reniced mlx.launch, which on a loaded machine can pause. (A killed rank named as a consequence in three
# clean-clone runs was no late exit: its supervisor, sent SIGTERM by mlx.launch before it had seen its worker die,
# reported the kill as "stopped by SIGTERM"; launch/supervisor.py no longer does.) The longer wait delays only a
# verdict that no rank's own failure ever explains (a link cut).
ROOT_CAUSE_GRACE_SECONDS = 2.0
CONSEQUENCE_GRACE_SECONDS = 6.0
# mlx.launch logs a rank's exit before it forwards that rank's last output; on a loaded machine
# (mlx.launch is reniced) that output can pause for seconds (1.5 s failed a 3-rank flood at load 20).
EXIT_GRACE_SECONDS = 5.0
_LOST_HINT = "run it again; if it recurs, report it with the run's logs"
# What a rank reports when a *peer* died or its link broke: a consequence, not a root cause.
COMM_ERROR = re.compile(
    r"connection to a peer was lost|(?:send|sending|recv|receiving) failed|closed by the peer"
    r"|too many send/recv errors|connection reset by peer|broken pipe",
    re.IGNORECASE,
)
_LAST_LINES = 5

Clock = Callable[[], float]


@dataclass(frozen=True)
class NodeExit(Event):
    """mlx.launch's own line about a rank's process ending (``Node with rank 1 exited with code 3``), read from
    its output by ``Ranks``: ``code`` None when the rank completed or was killed."""

    TAG = "_node_exit"
    rank: int
    line: str
    code: int | None = None


TRACKED: Registry[Event] = CONTROL.extended(NodeExit)  # what the tracker reads; the rest is a rank's progress


@dataclass
class RankFailure:
    """One thing that went wrong; the root cause is chosen among these."""

    rank: int | None
    host: str | None
    what: str
    hint: str | None = None
    secondary: bool = False  # a consequence of another failure (a lost peer, a stop)
    at: float = 0.0

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}" if self.rank is not None else "the run"


class FailureTracker:
    """The state of a run's ranks, built from their events; see the module docstring."""

    def __init__(self, hostfile: Hostfile, lease: float, clock: Clock = time.monotonic) -> None:
        self.hostfile, self.size, self.lease, self.clock = hostfile, hostfile.size, lease, clock
        self.failures: list[RankFailure] = []
        self.root_cause: RankFailure | None = None
        self.stopped = False  # once the ranks are being stopped, what they report is no failure
        self.finished: set[int] = set()  # said bye
        self.started: dict[int, Started] = {}
        self.started_at = clock()
        self._exited: set[int] = set()
        self._errored: set[int] = set()
        self._seen: dict[int, float] = {}
        self._node_exits: dict[int, tuple[str, bool, float]] = {}  # rank -> (what, secondary, deadline)
        self._comm_errors: set[int] = set()
        self._last_lines: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=_LAST_LINES)
        )
        self.launcher_lines: collections.deque[str] = collections.deque(maxlen=_LAST_LINES)  # mlx.launch's own
        self._last_progress: dict[int, tuple[str, int | None, float]] = {}  # rank -> (what, step, when)

    # --- events in ------------------------------------------------------------------

    def heard(self, rank: int, when: float) -> None:
        """Something arrived from ``rank``'s host at ``when`` (not when it is read)."""
        self._seen[rank] = when

    def record(self, data: Wire) -> bool:
        """Update the state from one event, as it arrived; True for the workers' own events (progress)."""
        kind = tag_of(data)
        if kind not in TRACKED:  # a worker's own event (loaded, done, result...): the rank goes on
            if kind != "token":  # rank 0's tokens come with its progress events, which say more
                self._last_progress[rank_of(data)] = (describe(kind), None, self.clock())
            return True
        event = TRACKED.from_wire(data)
        if isinstance(event, NodeExit):
            self._on_node_exit(event)
        elif isinstance(event, Lost):  # mlx.launch garbled frames of its output that could not be put back
            if event.critical:
                self.add(event.rank, f"{event.frames} frame(s) of its events were garbled in mlx.launch's "
                         "merged output (a token or a result would be missing)", _LOST_HINT)
        elif isinstance(event, Started):
            self.started[event.rank] = event
        elif isinstance(event, Log):
            if event.text.strip():
                self._last_lines[event.rank].append(event.text.strip())
            if COMM_ERROR.search(event.text):
                self._comm_errors.add(event.rank)
        elif isinstance(event, Progress):
            self._last_progress[event.rank] = (event.what or describe(kind), event.step, self.clock())
            return True
        elif isinstance(event, Bye):
            self._last_progress[event.rank] = (describe(kind), None, self.clock())
            self.finished.add(event.rank)
            return True
        elif isinstance(event, (Exited, Error)):
            self._last_progress[event.rank] = (describe(kind), None, self.clock())
            if isinstance(event, Exited):
                self._on_exited(event)
            else:
                self._on_error(event)
        return False

    def _on_error(self, event: Error) -> None:
        comm = bool(COMM_ERROR.search(event.message))
        self._errored.add(event.rank)
        if comm:
            self._comm_errors.add(event.rank)
        self.add(event.rank, f"{event.type}: {event.message}", event.hint, secondary=comm)

    def _on_exited(self, event: Exited) -> None:
        rank, code, stopped = event.rank, event.returncode, event.stopped
        self._exited.add(rank)
        if event.finished and code == 0:
            return
        if rank in self._errored:
            return  # its error event already says what went wrong
        if stopped == "silent":
            self.add(rank, f"its worker stopped answering: no word from it for {WORKER_SILENCE_SECONDS:g} s, though "
                           "its host still answers; it was killed",
                     "the process was stopped (SIGSTOP), frozen or hung; its log in the run directory may say more")
            return
        if stopped == "lease":
            self.add(rank, f"stopped its worker: no heartbeat from this controller for {self.lease:g} s",
                     "the network between this machine and that host failed for a while")
            return
        if stopped:
            self.add(rank, f"stopped by {stopped}", secondary=True)
            return
        status = describe_status(code)
        if code == 0:
            self.add(rank, f"{status} before finishing (mlx.launch would leave the other ranks waiting)")
            return
        last = self._last_lines.get(rank)
        detail = f" (last output: {last[-1]})" if last and code and code > 0 else ""
        self.add(rank, f"{status}{detail}", secondary=rank in self._comm_errors)

    def _on_node_exit(self, event: NodeExit) -> None:
        """mlx.launch saw a rank's process end; its supervisor's ``exited`` normally says more."""
        rank, code = event.rank, event.code
        if "completed" in event.line and rank in self.finished:
            return
        if "was killed" in event.line:
            what, secondary = "was stopped by mlx.launch after another rank failed", True
        elif code == 255 and not self.hostfile.hosts[rank].is_local:
            what, secondary = "its ssh connection failed (exit status 255)", False
        else:
            what, secondary = describe_status(code if code is not None else 0), False
            if code in (0, None):
                what += " before finishing"
        self._node_exits.setdefault(rank, (what, secondary, self.clock() + EXIT_GRACE_SECONDS))

    # --- verdicts ---------------------------------------------------------------------

    def check_liveness(self, timeout: float, last_progress: float) -> None:
        """The watchdogs: a silent host (no ``alive`` for the lease), no progress, lost exits."""
        now = self.clock()
        for rank, (what, secondary, deadline) in list(self._node_exits.items()):
            # Its output may still be arriving (a flood read behind mlx.launch's note): wait for it.
            streaming = now - self._seen.get(rank, -math.inf) < EXIT_GRACE_SECONDS
            if now > deadline and not streaming and rank not in self._exited:
                del self._node_exits[rank]
                self.add(rank, what, secondary=secondary)
        running = [r for r in self.started if r not in self._exited]
        silent = {r: now - self._seen.get(r, now) for r in running}
        lost = [r for r, quiet in silent.items() if quiet > self.lease]
        stalled = now - last_progress > timeout
        if stalled and not lost:
            lost = [r for r, quiet in silent.items() if quiet > 3 * HEARTBEAT_SECONDS]
        unstarted = [r for r in range(self.size) if r not in self.started and r not in self._exited]
        if lost:
            rank = max(lost, key=lambda r: silent[r])
            self.add(rank, f"stopped answering: nothing heard from its host for {silent[rank]:.0f} s",
                     f"that host or the network to it may be down (its rank stops itself after "
                     f"{self.lease:g} s without word from here); check it with `mlxpipe doctor`")
        elif unstarted and (stalled or now - self.started_at > START_TIMEOUT_SECONDS):
            self.add(unstarted[0], f"never started: no word from it in {now - self.started_at:.0f} s",
                     "check that host with `mlxpipe doctor`, and its log in the run directory")
        elif stalled:
            self.add(None, f"no progress from any rank for {timeout:g} s, though every host still answers; "
                     f"last reported: {self.stall_report(now)}",
                     f"{self.waiting_on()}mlx's ring has no receive timeout; raise --timeout if the model is just slow")

    def stall_report(self, now: float) -> str:
        """Each rank's last progress and how long ago: ``rank 0 decode token 4 (5 s ago), ...``."""
        parts = []
        for rank in range(self.size):
            what, _, when = self._last_progress.get(rank, ("nothing since it started", None, self.started_at))
            parts.append(f"rank {rank} {what} ({now - when:.0f} s ago)")
        return ", ".join(parts)

    def waiting_on(self) -> str:
        """Which rank waits on which, when the ranks' steps say so (every rank does the same steps)."""
        steps = {r: step for r, (_, step, _) in self._last_progress.items() if isinstance(step, int)}
        if len(steps) < self.size or len(set(steps.values())) < 2:
            return "a rank may be stuck in a collective; "
        behind = min(steps.values())
        # The earliest stage among the late ones (stages receive from rank + 1) explains the rest.
        rank = max(r for r, step in steps.items() if step == behind)
        if rank + 1 < self.size:
            return (f"rank {rank} is behind (step {behind}, rank {rank + 1} at {steps[rank + 1]}): it waits for "
                    f"rank {rank + 1}, which went on without delivering to it; ")
        return f"rank {rank} is behind the others (step {behind}): they wait for it; "

    def add(self, rank: int | None, what: str, hint: str | None = None, *, secondary: bool = False) -> None:
        if self.stopped:
            return  # what the ranks report while being stopped is no failure of theirs
        self.failures.append(RankFailure(rank, self.host(rank), what, hint, secondary, at=self.clock()))

    def flush_node_exits(self) -> None:
        """mlx.launch has ended: the exits it reported without a supervisor's word are failures now."""
        for rank, (what, secondary, _) in self._node_exits.items():
            if rank not in self._exited:
                self.add(rank, what, secondary=secondary)
        self._node_exits.clear()

    def on_launch_end(self) -> None:
        """mlx.launch exited: fine if every rank said bye, else the ranks that did not failed."""
        self.flush_node_exits()
        missing = sorted(set(range(self.size)) - self.finished)
        if missing and not self.failures:
            said = self.launcher_lines[-1] if self.launcher_lines else None
            self.add(missing[0], "ended before finishing: mlx.launch exited" + (f" ({said})" if said else ""))

    # --- the root cause -------------------------------------------------------------

    @property
    def plain(self) -> bool:
        """A failure that is no consequence of another is known: the root cause is plain."""
        return any(not f.secondary for f in self.failures)

    @property
    def grace_ends(self) -> float:
        """Until when to collect more failures before choosing the root cause (longer while none is plain)."""
        return min(f.at for f in self.failures) + (ROOT_CAUSE_GRACE_SECONDS if self.plain else
                                                   CONSEQUENCE_GRACE_SECONDS)

    def choose_root_cause(self) -> RankFailure:
        """The first failure that is no consequence of another (else the first of all)."""
        if self.root_cause is None:
            primary = [f for f in self.failures if not f.secondary]
            self.root_cause = min(primary or self.failures, key=lambda f: f.at)
        return self.root_cause

    def error(self, run_dir: Path) -> LaunchError:
        """The error to raise: the root cause first, then what followed it, then where the logs are."""
        root = self.choose_root_cause()
        others = [f for f in self.failures if f is not root and f.rank != root.rank]
        parts = [root.hint] if root.hint else []
        if others:
            first = min(others, key=lambda f: f.at)
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            parts.append(f"the root cause; after it {first.where} failed ({first.what}){more}")
        log = f" (rank-{root.rank}.log)" if root.rank is not None else ""
        parts.append(f"every rank was stopped; logs: {run_dir}{log}")
        message = f"{root.where}: {root.what}" if root.rank is not None else root.what
        return LaunchError(message, "; ".join(parts))

    def host(self, rank: int | None) -> str | None:
        if rank is None or not 0 <= rank < self.size:
            return None
        return self.hostfile.hosts[rank].ssh


def describe(kind: str) -> str:
    """What a worker event of ``kind`` says the rank was doing, for the stall report."""
    return {"loaded": "loaded its layers", "done": "finished a request",
            "result": "finished a request", "batch_done": "finished a batch"}.get(kind, kind)


def describe_status(code: int | None) -> str:
    """``killed by SIGKILL (exit status -9)``, ``exited with status 3``."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit status {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"
