"""launch/supervisor.py: the per-rank supervisor, run as mlx.launch runs it, over a small worker script.

The supervisor is a real subprocess (``python -m mlxpipe.launch.supervisor``) with
``MLX_RANK`` set; its output is read back through ``frames.Demux`` as the
controller reads it. No MLX rank starts: the worker is a few lines of Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from mlxpipe.launch import frames
from mlxpipe.launch.supervisor import HEARTBEAT_LINE, main
from mlxpipe.protocol import wire

RANK = 1


def supervise(worker: str, stdin: str = "", lease: float = 30.0, keep_open: float = 0.0,
              timeout: float = 60.0, silence: float = 5.0) -> tuple[int, list[frames.Item]]:
    """Run ``worker`` (Python source) under the supervisor; its exit status and what the controller reads.

    ``stdin`` is written at once; it is closed after ``keep_open`` seconds (a controller that is still there)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxpipe.launch.supervisor", "--lease", str(lease), "--silence", str(silence), "--",
         "-c", textwrap.dedent(worker)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MLX_RANK": str(RANK)},
    )
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.flush()
    time.sleep(keep_open)
    out, _ = proc.communicate(timeout=timeout)
    demux = frames.Demux()
    items: list[frames.Item] = []
    for line in out.splitlines(keepends=True):
        items += demux.feed(line)
    return proc.returncode, items + demux.close()


def events(items: list[frames.Item], kind: str | None = None) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict) and (kind is None or i["event"] == kind)]


def test_the_workers_lines_become_events_with_its_rank_and_requests_reach_it() -> None:
    code, items = supervise("""
        import sys
        from mlxpipe.protocol import wire
        print("loading the share", flush=True)
        wire.emit_wire({"event": "token", "id": "a", "token": 7})
        line = sys.stdin.readline()
        wire.emit_wire({"event": "echo", "line": line.strip()})
        wire.emit_wire({"event": "bye"})
    """, stdin=f"{HEARTBEAT_LINE}\n{{\"type\": \"generate\"}}\n")
    assert code == 0
    started, *_ = events(items, "started")
    assert started["rank"] == RANK and started["pid"] > 0 and started["supervisor"] > 0
    assert {"event": "log", "rank": RANK, "stream": "stdout", "text": "loading the share"} in events(items, "log")
    assert events(items, "token") == [{"event": "token", "id": "a", "token": 7, "rank": RANK}]
    # The heartbeat renews the lease and stops there; the request goes on to the worker.
    assert events(items, "echo") == [{"event": "echo", "line": '{"type": "generate"}', "rank": RANK}]
    assert events(items, "exited") == [{"event": "exited", "rank": RANK, "returncode": 0, "signal": None,
                                        "stopped": None, "finished": True}]


def test_an_error_events_traceback_becomes_log_lines_before_it() -> None:
    code, items = supervise("""
        from mlxpipe.protocol import wire
        wire.emit_wire({"event": "error", "type": "ModelError", "message": "no config.json",
                        "traceback": "Traceback:\\n  line 1"})
        raise SystemExit(3)
    """)
    assert code == 3
    texts = [e["text"] for e in events(items, "log")]
    assert texts[-2:] == ["Traceback:", "  line 1"]
    (error,) = events(items, "error")
    assert error == {"event": "error", "type": "ModelError", "message": "no config.json", "rank": RANK}
    assert items.index(error) > max(items.index(e) for e in events(items, "log"))
    assert events(items, "exited")[0]["finished"] is False  # no bye: it did not finish


def test_a_worker_killed_by_a_signal_is_reported_with_the_signal() -> None:
    code, items = supervise("""
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert code == 128 + 9
    (exited,) = events(items, "exited")
    assert (exited["returncode"], exited["signal"], exited["finished"]) == (-9, "SIGKILL", False)


def test_a_signal_that_comes_after_the_worker_died_is_not_said_to_have_stopped_it() -> None:
    # mlx.launch stops every rank (SIGTERM to its supervisor) once one has failed. When a worker is killed, its
    # peer's lost connection can fail first, and the SIGTERM reach this supervisor before it has seen its worker
    # end: the exit must still say SIGKILL on its own, or the controller takes the kill for a consequence. Here the
    # order is made certain: the supervisor is stopped, sent SIGTERM, its worker dies, then it is continued.
    code, items = supervise("""
        import os, signal, subprocess
        supervisor = os.getppid()
        subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {supervisor}"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.kill(supervisor, signal.SIGSTOP)
        os.kill(supervisor, signal.SIGTERM)  # held until it continues
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert code == 128 + 9
    (exited,) = events(items, "exited")
    assert (exited["returncode"], exited["signal"], exited["stopped"]) == (-9, "SIGKILL", None)


def test_a_signal_stops_a_running_worker_and_its_exit_says_so() -> None:
    code, items = supervise("""
        import os, signal, time
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(60)
    """)
    assert code == 128 + 15
    (exited,) = events(items, "exited")
    assert (exited["signal"], exited["stopped"]) == ("SIGTERM", "SIGTERM")


def test_a_worker_whose_controller_stops_sending_heartbeats_is_stopped_when_the_lease_runs_out() -> None:
    started = time.monotonic()
    code, items = supervise("""
        import time
        time.sleep(60)
    """, stdin=f"{HEARTBEAT_LINE}\n", lease=1.0, keep_open=4.0)
    assert code == 128 + 15  # SIGTERM
    (exited,) = events(items, "exited")
    assert (exited["stopped"], exited["signal"]) == ("lease", "SIGTERM")
    assert time.monotonic() - started < 30
    assert len(events(items, "alive")) >= 1  # its own heartbeat went out while it ran


def test_a_stopped_worker_is_killed_once_it_has_been_silent_and_its_exit_says_so() -> None:
    code, items = supervise("""
        import os, signal, time
        from mlxpipe.protocol import wire
        wire.start_beating()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)  # what `kill -STOP` does to a rank: no more beats, no exit
    """, silence=1.5)
    assert code == 128 + 9
    (exited,) = events(items, "exited")
    assert (exited["stopped"], exited["signal"], exited["finished"]) == ("silent", "SIGKILL", False)
    assert not any(wire.WORKER_BEAT_LINE in e.get("text", "") for e in events(items, "log"))  # kept here


def test_a_worker_busy_for_longer_than_the_silence_still_beats_and_is_left_alone() -> None:
    code, items = supervise("""
        import time
        from mlxpipe.protocol import wire
        wire.start_beating()
        time.sleep(3.0)  # a long step (mlx computes without Python's lock): the beats go on
        wire.emit_wire({"event": "bye"})
    """, silence=1.5)
    assert code == 0
    assert events(items, "exited")[0]["stopped"] is None


def test_a_long_plain_line_is_cut_into_log_events() -> None:
    code, items = supervise("""
        print("x" * 4500, flush=True)
    """)
    assert code == 0
    assert [len(e["text"]) for e in events(items, "log")] == [2000, 2000, 500]


def test_no_worker_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--lease", "5", "--"])
    assert exit_.value.code == 2
