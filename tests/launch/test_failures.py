"""launch/failures.py, pure: the failure tracker picks the root cause and names stalls, on a clock moved by hand.

The order events arrive in cannot be forced with real ranks; the runs that go
wrong on real ranks and on the ssh test cluster are in ``tests/e2e/test_failures.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fixtures.hostfiles import LOCAL
from mlxpipe.launch.failures import EXIT_GRACE_SECONDS, FailureTracker

# --- Choosing the root cause (the order events arrive in cannot be forced with real ranks) --------------


def _progress(rank: int, step: int, what: str) -> dict[str, Any]:
    return {"event": "progress", "rank": rank, "step": step, "what": what}


@pytest.mark.parametrize("progress, report, waits", [
    # A stage that ends on a block without a cache never sent its prefill: rank 0 waits on rank 1.
    ([_progress(0, 1, "prefill 0/40 tokens"), _progress(1, 6, "decode token 2")],
     "rank 0 prefill 0/40 tokens (7 s ago), rank 1 decode token 2 (7 s ago)",
     "rank 0 is behind (step 1, rank 1 at 6): it waits for rank 1, which went on without delivering to it"),
    # The first stage itself stopped: the others wait for it.
    ([_progress(0, 7, "decode token 5"), _progress(1, 6, "decode token 4"), _progress(2, 7, "decode token 5")],
     "rank 0 decode token 5 (7 s ago), rank 1 decode token 4 (7 s ago), rank 2 decode token 5 (7 s ago)",
     "rank 1 is behind (step 6, rank 2 at 7): it waits for rank 2, which went on without delivering to it"),
    ([_progress(0, 5, "decode token 3"), _progress(1, 4, "decode token 2")],
     "rank 0 decode token 3 (7 s ago), rank 1 decode token 2 (7 s ago)",
     "rank 1 is behind the others (step 4): they wait for it"),
    # Ranks at the same step: nothing to say about who waits.
    ([_progress(0, 3, "prefill 2/3 tokens"), _progress(1, 3, "prefill 2/3 tokens")],
     "rank 0 prefill 2/3 tokens (7 s ago), rank 1 prefill 2/3 tokens (7 s ago)",
     "a rank may be stuck in a collective"),
])
def test_stall_report_says_where_each_rank_stands(progress: list[dict[str, Any]], report: str, waits: str,
                                                  tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = FailureTracker(_hostfile(tmp_path, [LOCAL] * len(progress)), lease=30.0, clock=clock)
    for rank in range(len(progress)):
        tracker.record({"event": "started", "rank": rank})
    for event in progress:
        tracker.record(event)
    clock.now = 3.0
    tracker.check_liveness(timeout=5.0, last_progress=0.0)
    assert tracker.failures == []  # within the watchdog's bound
    clock.now = 7.0
    tracker.check_liveness(timeout=5.0, last_progress=0.0)
    error = tracker.error(tmp_path)
    assert error.message == (
        f"no progress from any rank for 5 s, though every host still answers; last reported: {report}"
    )
    assert str(error.hint).startswith(waits + "; mlx's ring has no receive timeout; raise --timeout")


def test_a_silent_host_is_named_before_the_stall(tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = FailureTracker(_hostfile(tmp_path, [LOCAL, {"ssh": "127.0.0.2", "ips": ["127.0.0.2"]}]),
                             lease=10.0, clock=clock)
    for rank in (0, 1):
        tracker.record({"event": "started", "rank": rank})
        tracker.heard(rank, 0.0)
    clock.now = 8.0
    tracker.heard(0, 8.0)  # rank 0's host still sends its heartbeats; rank 1's went quiet at 0
    tracker.check_liveness(timeout=5.0, last_progress=0.0)
    error = tracker.error(tmp_path)
    assert error.message == "rank 1 on 127.0.0.2: stopped answering: nothing heard from its host for 8 s"
    assert "check it with `mlxpipe doctor`" in str(error.hint)


@pytest.mark.parametrize("streaming", [True, False])
def test_an_exit_is_judged_once_the_ranks_output_has_arrived(streaming: bool, tmp_path: Path) -> None:
    """mlx.launch notes a rank's exit before its last output, which a flood may hold back for long."""
    clock = FakeClock()
    tracker = FailureTracker(_hostfile(tmp_path, [LOCAL, LOCAL]), lease=30.0, clock=clock)
    tracker.record({"event": "_node_exit", "rank": 1, "line": "Node with rank 1 completed", "code": None})
    for clock.now in (1.0, EXIT_GRACE_SECONDS, 2 * EXIT_GRACE_SECONDS):  # past the grace: still being read, or not
        if streaming:
            tracker.heard(1, clock.now)
        tracker.check_liveness(timeout=60.0, last_progress=clock.now)
    assert bool(tracker.failures) is not streaming
    tracker.record({"event": "bye", "rank": 1})
    tracker.record({"event": "exited", "rank": 1, "returncode": 0, "finished": True})
    tracker.check_liveness(timeout=60.0, last_progress=clock.now)
    assert bool(tracker.failures) is not streaming


PEER_LOST = {"event": "error", "type": "RuntimeError", "message": "[ring] connection to a peer was lost"}


@pytest.mark.parametrize("events, expected", [
    # The peer that noticed comes first; the rank that was killed is still the root cause.
    ([{**PEER_LOST, "rank": 0}, {"event": "exited", "rank": 1, "returncode": -9}],
     "rank 1 on 127.0.0.2: killed by SIGKILL (exit status -9)"),
    # A rank that aborts after a lost peer is a consequence too.
    ([{"event": "log", "rank": 0, "text": "[ring] Socket 4 was closed by the peer"},
      {"event": "exited", "rank": 0, "returncode": -6}, {"event": "exited", "rank": 1, "returncode": 3}],
     "rank 1 on 127.0.0.2: exited with status 3"),
    # Only consequences: the first observed is reported.
    ([{**PEER_LOST, "rank": 1}, {**PEER_LOST, "rank": 0}],
     "rank 1 on 127.0.0.2: RuntimeError: [ring] connection to a peer was lost"),
    # Exit 0 without bye, while mlx.launch's own line about it comes first.
    ([{"event": "_node_exit", "rank": 1, "line": "Node with rank 1 completed", "code": None},
      {"event": "exited", "rank": 1, "returncode": 0, "finished": False}],
     "rank 1 on 127.0.0.2: exited with status 0 before finishing (mlx.launch would leave the other ranks waiting)"),
    # A worker that fell silent (stopped, hung) was killed by its supervisor: it, not the peer waiting on it.
    ([{**PEER_LOST, "rank": 0},
      {"event": "exited", "rank": 1, "returncode": -9, "signal": "SIGKILL", "stopped": "silent"}],
     "rank 1 on 127.0.0.2: its worker stopped answering: no word from it for 5 s, though its host still answers; "
     "it was killed"),
    # A token or result garbled in mlx.launch's output beyond repair fails the run, naming the rank.
    ([{"event": "lost", "rank": 1, "frames": 2, "critical": False},
      {"event": "lost", "rank": 1, "frames": 2, "critical": True}],
     "rank 1 on 127.0.0.2: 2 frame(s) of its events were garbled in mlx.launch's merged output "
     "(a token or a result would be missing)"),
    # Ranks stopped by mlx.launch after the failure are not blamed.
    ([{"event": "exited", "rank": 0, "returncode": -15, "stopped": "SIGTERM"},
      {"event": "error", "rank": 1, "type": "ModelError", "message": "no config.json in /m", "hint": "copy it"}],
     "rank 1 on 127.0.0.2: ModelError: no config.json in /m"),
])
def test_root_cause_is_not_a_consequence(events: list[dict[str, Any]], expected: str, tmp_path: Path) -> None:
    clock = FakeClock()
    tracker = FailureTracker(_hostfile(tmp_path, [LOCAL, {"ssh": "127.0.0.2", "ips": ["127.0.0.2"]}]),
                             lease=30.0, clock=clock)
    for event in events:
        clock.now += 0.1  # in the order they arrive
        tracker.record(event)
    tracker.on_launch_end()
    error = tracker.error(tmp_path)
    assert error.message == expected
    assert f"logs: {tmp_path}" in str(error.hint)


class FakeClock:
    """The tracker's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _hostfile(tmp_path: Path, hosts: list[dict[str, Any]]) -> Any:
    from mlxpipe.cluster.hostfile import load_hostfile

    path = tmp_path / "h.json"
    path.write_text(json.dumps(hosts))
    return load_hostfile(path)
