"""worker/progress.py: a rank's progress events, at most every second and soon after it stops advancing."""

from __future__ import annotations

import threading
import time
from typing import Any

from mlxpipe.protocol.message import Event
from mlxpipe.worker.progress import PROGRESS_SECONDS, Progress


class Events:
    """The events a Progress emits, as the rank's event stream would carry them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.seen.append(event.to_wire())

    def wait_for(self, expected: dict[str, Any], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if expected in self.seen:
                    return
            time.sleep(0.05)
        raise AssertionError(f"no {expected} in {self.seen}")


def test_a_rank_that_stops_advancing_reports_exactly_where_it_stands() -> None:
    events = Events()
    progress = Progress(events, rank=2)
    progress.prefill(8, 40)
    progress.prefill(16, 40)
    progress.decode(1)
    events.wait_for({"event": "progress", "rank": 2, "what": "decode token 1", "step": 3})
    # Steps it passed while reporting nothing new are not all sent: the latest is what matters.
    assert all(e["step"] <= 3 for e in events.seen)


def test_the_engines_ticks_are_the_step_and_reset_goes_back_to_idle() -> None:
    events = Events()
    progress = Progress(events, rank=0)
    progress.tick(41, "decode")
    events.wait_for({"event": "progress", "rank": 0, "what": "decode (tick 41)", "step": 41})
    progress.reset()
    events.wait_for({"event": "progress", "rank": 0, "what": "idle", "step": 0})


def test_an_unchanged_rank_sends_nothing_more() -> None:
    events = Events()
    progress = Progress(events, rank=1)
    progress.decode(5)
    events.wait_for({"event": "progress", "rank": 1, "what": "decode token 5", "step": 1})
    count = len(events.seen)
    time.sleep(3 * PROGRESS_SECONDS)
    assert len(events.seen) == count


def test_the_reporter_thread_ends_with_its_progress() -> None:
    # A test driver makes a RankLoop (and so a Progress) per case: hundreds of reporter threads left waking
    # 4 times a second slowed every later case.
    import gc

    before = set(threading.enumerate())
    progress = Progress(Events(), rank=0)
    (thread,) = set(threading.enumerate()) - before
    del progress
    gc.collect()
    thread.join(timeout=5 * PROGRESS_SECONDS)
    assert not thread.is_alive()
