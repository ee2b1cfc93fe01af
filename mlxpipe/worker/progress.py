"""A rank's ``progress`` events: where it stands, for the controller's stall watchdog."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from mlxpipe.protocol import events
from mlxpipe.protocol.message import Event

PROGRESS_SECONDS = 1.0  # the most often a rank reports decode progress: the controller's stall watchdog
Emit = Callable[[Event], None]  # where a rank's events go (``wire.emit``; tests keep them)


class Progress:
    """This rank's ``progress`` events, which feed the controller's stall watchdog.

    ``step`` counts units of work of the current request (prefill chunks, then
    tokens, or ticks); every rank does the same steps, so a rank whose step lags
    the others' is the one waiting. A reporter thread sends the latest step at
    most every ``PROGRESS_SECONDS``, and soon after the rank stops advancing, so
    a stuck rank's last report is exactly where it stands (MLX releases the GIL
    while it waits in a collective). The thread ends once nothing holds the
    ``Progress`` (a test driver makes one per case).
    """

    def __init__(self, emit: Emit, rank: int) -> None:
        self._emit, self.rank = emit, rank
        self.step, self.what = 0, "idle"
        self._sent: tuple[int, str] | None = None
        self._sent_at = self._changed_at = 0.0
        self._lock = threading.Lock()
        threading.Thread(target=_report, args=(weakref.ref(self),), daemon=True, name="mlxpipe-progress").start()

    def reset(self) -> None:
        self._set(0, "idle")

    def prefill(self, done: int, total: int) -> None:
        self._set(self.step + 1, f"prefill {done}/{total} tokens")

    def decode(self, tokens: int) -> None:
        self._set(self.step + 1, f"decode token {tokens}")

    def tick(self, tick: int, doing: str) -> None:
        """The engine's ticks: the same on every rank, so a lagging tick is the waiting rank."""
        self._set(tick, f"{doing} (tick {tick})")

    def _set(self, step: int, what: str) -> None:
        with self._lock:
            self.step, self.what, self._changed_at = step, what, time.monotonic()

    def _report_due(self) -> None:
        """Send the latest step if it is due."""
        now = time.monotonic()
        with self._lock:
            current = (self.step, self.what)
            due = current != self._sent and (
                now - self._sent_at >= PROGRESS_SECONDS or now - self._changed_at >= PROGRESS_SECONDS / 2
            )
            if due:
                self._sent, self._sent_at = current, now
        if due:
            self._emit(events.Progress(rank=self.rank, what=current[1], step=current[0]))


def _report(ref: weakref.ref[Progress]) -> None:
    """The reporter thread: holds its ``Progress`` only while it reports, and ends when it is gone."""
    while True:
        time.sleep(PROGRESS_SECONDS / 4)
        progress = ref()
        if progress is None:
            return
        progress._report_due()
        del progress
