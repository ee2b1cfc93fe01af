"""mlx.launch run through ``launch/mlx_launch.py``: its I/O threads wait instead of spinning."""

from __future__ import annotations

import os
import select
import types

from mlxpipe.launch import mlx_launch


def test_the_installed_mlx_launcher_is_patched() -> None:
    # If a new mlx lays its launcher out otherwise, the patch stands down: this says so before users pay the spin.
    from mlx._distributed_utils import launch

    saved = launch.select
    try:
        assert mlx_launch.patch(launch)
        assert launch.select is not select.select
    finally:
        launch.select = saved


def test_a_launcher_laid_out_otherwise_runs_unpatched() -> None:
    other = types.SimpleNamespace(select=select.select)  # no _launch_with_io
    assert not mlx_launch.patch(other)
    assert other.select is select.select
    assert not mlx_launch.patch(types.SimpleNamespace(_launch_with_io=None))


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
