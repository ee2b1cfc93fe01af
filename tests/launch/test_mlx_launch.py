"""mlx.launch run through ``launch/mlx_launch.py``: its I/O threads wait instead of spinning, and pass each rank's
output on in whole lines."""

from __future__ import annotations

import os
import select
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest

from mlxpipe.launch import mlx_launch


def test_the_installed_mlx_launcher_is_patched() -> None:
    # If a new mlx lays its launcher out otherwise, the patch stands down: this says so before users pay the spin.
    from mlx._distributed_utils import launch

    saved = launch.select, launch.os
    try:
        assert mlx_launch.patch(launch)
        assert launch.select is not select.select
        assert isinstance(launch.os, mlx_launch.WholeLines)
    finally:
        launch.select, launch.os = saved


def test_a_launcher_laid_out_otherwise_runs_unpatched() -> None:
    other = types.SimpleNamespace(select=select.select)  # no _launch_with_io
    assert not mlx_launch.patch(other)
    assert other.select is select.select
    assert not mlx_launch.patch(types.SimpleNamespace(_launch_with_io=None))
    assert not mlx_launch.patch(types.SimpleNamespace(select=select.select, _launch_with_io=None))  # no os


def test_a_writable_pipe_no_longer_ends_the_wait_at_once() -> None:
    calls: list[tuple[int, int, float | None]] = []

    def real(r, w, x, timeout=None):  # type: ignore[no-untyped-def]
        calls.append((len(r), len(w), timeout))
        return select.select(r, w, x, timeout)

    patched = mlx_launch.sleeping_select(real)
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    try:
        readable, writable, _ = patched([out_r], [in_w], [], 1.0)
        assert (readable, writable) == ([], [in_w])
        # It waited on the output alone, for WRITE_POLL_S, before asking about the input.
        assert calls == [(1, 0, mlx_launch.WRITE_POLL_S), (0, 1, 0)]
        os.write(out_w, b"x")
        readable, writable, _ = patched([out_r], [in_w], [], 1.0)
        assert (readable, writable) == ([out_r], [in_w])
        # Without a write to ask about, and with mlx.launch's own zero timeout, the call is select's own.
        calls.clear()
        assert patched([out_r], [], [], 0) == ([out_r], [], [])
        assert calls == [(1, 0, 0)]
    finally:
        for fd in (out_r, out_w, in_r, in_w):
            os.close(fd)


def _in_a_thread(call: Callable[[], Any]) -> Any:
    """``call()``'s result (or exception) from a thread other than the main one, as mlx.launch's I/O threads."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box[0]


def test_a_rank_s_output_is_read_in_whole_lines_held_across_reads() -> None:
    lines = mlx_launch.WholeLines()
    out_r, out_w = os.pipe()
    os.set_blocking(out_r, False)
    try:
        os.write(out_w, b"@@mlxpipe@@ #1:0:c.:")  # a frame cut inside its header by a read
        assert isinstance(_in_a_thread(lambda: lines.read(out_r, 8192)), BlockingIOError)  # nothing whole yet
        os.write(out_w, b"2:ab\nthe next li")
        assert _in_a_thread(lambda: lines.read(out_r, 8192)) == b"@@mlxpipe@@ #1:0:c.:2:ab\n"
        os.write(out_w, b"ne\nand a last one without its newline")
        assert _in_a_thread(lambda: lines.read(out_r, 8192)) == b"the next line\n"
        os.close(out_w)
        out_w = -1
        # The output ends: what is held, then the end.
        assert _in_a_thread(lambda: lines.read(out_r, 8192)) == b"and a last one without its newline"
        assert _in_a_thread(lambda: lines.read(out_r, 8192)) == b""
        # mlx.launch's main thread reads the controller's messages: os.read's own pieces.
        in_r, in_w = os.pipe()
        os.write(in_w, b"half a li")
        assert lines.read(in_r, 8192) == b"half a li"
        os.close(in_r), os.close(in_w)
        assert lines.getcwd() == os.getcwd()  # the rest is os's
    finally:
        os.close(out_r)
        if out_w >= 0:
            os.close(out_w)


def test_a_line_longer_than_line_max_is_passed_on_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlx_launch, "LINE_MAX", 10)
    lines = mlx_launch.WholeLines()
    out_r, out_w = os.pipe()
    try:
        os.write(out_w, b"x" * 12)
        assert _in_a_thread(lambda: lines.read(out_r, 8192)) == b"x" * 12
    finally:
        os.close(out_r), os.close(out_w)
