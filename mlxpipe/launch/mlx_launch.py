"""MLX's own ``mlx.launch``, run unchanged but for one wait: its I/O threads sleep instead of spinning.

``mlx.launch`` gives each rank a thread that moves bytes between the rank and
the launcher (``mlx/_distributed_utils/launch.py: _launch_with_io``). On every
pass that thread asks ``select`` whether the rank's standard input can be
written, whether or not it has bytes to write. A pipe nearly always can be, so
``select`` returns at once and the thread never sleeps: one core per rank,
for as long as the ranks run, idle server included. On Linux, where each
session is scheduled as a group, renicing mlx.launch does not stop it taking
half of a 2-core machine from everything outside its session.

Here the threads wait on the rank's output alone, for at most ``WRITE_POLL_S``
at a time, then check whether standard input can be written, so bytes the
controller sent still reach the rank within ``WRITE_POLL_S``. Output from the
ranks wakes them at once, as before.

The same threads read a rank's output in raw pieces of up to 8 KiB, and the
launcher writes every rank's pieces to one stream as they come: a line cut by
a read can have another rank's piece written into the cut. Here a thread's
read returns whole lines (``WholeLines``), holding a cut line's start until its
rest comes, so the merged stream is every rank's lines, each whole. The
controller's frames (``launch/frames.py``) no longer need putting back
together; they still can be, where the launcher runs unpatched.

Every other line of mlx.launch runs as MLX wrote it. Should a later mlx lay
its launcher out otherwise, it runs unpatched (the old spin and cut lines,
nothing worse).

    python -m mlxpipe.launch.mlx_launch ARGS...   # the same ARGS as mlx.launch
"""

from __future__ import annotations

import os as _os_module
import select as _select_module
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

# How the controller runs it: python -m LAUNCHER, then mlx.launch's own arguments.
LAUNCHER = "mlxpipe.launch.mlx_launch"
# The longest a controller's message waits in mlx.launch before it is written to a rank's standard input.
WRITE_POLL_S = 0.002
# The longest line held back whole: a longer one is passed on in pieces, as mlx.launch does (frames are < 4 KiB).
LINE_MAX = 1 << 20

Select = Callable[..., tuple[list[Any], list[Any], list[Any]]]


def sleeping_select(real: Select) -> Select:
    """``select`` as mlx.launch's I/O threads call it, waiting on reads instead of returning at once."""

    def select(rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        if not wlist:
            return real(rlist, wlist, xlist, timeout)
        wait = WRITE_POLL_S if timeout is None else min(timeout, WRITE_POLL_S)
        readable, _, errors = real(rlist, [], xlist, wait)
        _, writable, _ = real([], wlist, [], 0)
        return readable, writable, errors

    return select


class WholeLines:
    """``os`` as mlx.launch's I/O threads see it: ``read`` returns whole lines of a rank's output.

    A read that ends inside a line returns the lines before the cut and holds
    the rest until the line's newline comes (or the output ends); a read with
    no whole line raises ``BlockingIOError``, which the thread takes as "nothing
    to read yet". The main thread's reads (the controller's messages on
    standard input) are ``os.read``'s own. Everything else is ``os``'s.
    """

    def __init__(self, real: Any = _os_module) -> None:
        self._real = real
        self._held: dict[int, bytes] = {}  # per file descriptor: a line's start, read before its rest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def read(self, fd: int, size: int) -> bytes:
        if threading.current_thread() is threading.main_thread():
            return bytes(self._real.read(fd, size))
        data = bytes(self._real.read(fd, size))  # BlockingIOError when nothing is there: as before
        held = self._held.pop(fd, b"") + data
        if not data:  # the output ended: a last line without its newline, then the end
            return held
        cut = held.rfind(b"\n") + 1
        if cut == 0 and len(held) < LINE_MAX:
            self._held[fd] = held
            raise BlockingIOError(f"no whole line on fd {fd} yet")
        cut = cut or len(held)
        if cut < len(held):
            self._held[fd] = held[cut:]
        return held[:cut]


def patch(launch_module: Any) -> bool:
    """Make ``launch_module``'s I/O threads sleep and pass whole lines on; False (and nothing changed) if it is not
    laid out as expected."""
    if getattr(launch_module, "select", None) is not _select_module.select:
        return False
    if getattr(launch_module, "os", None) is not _os_module or not hasattr(launch_module, "_launch_with_io"):
        return False
    launch_module.select = sleeping_select(_select_module.select)
    launch_module.os = WholeLines()
    return True


def main() -> None:
    from mlx._distributed_utils import launch

    patch(launch)
    sys.argv[0] = "mlx.launch"
    sys.exit(launch.main())  # as mlx.launch's own console script ends


if __name__ == "__main__":
    main()
