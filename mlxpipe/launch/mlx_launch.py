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
ranks wakes them at once, as before. Every other line of mlx.launch runs as
MLX wrote it. Should a later mlx lay its launcher out otherwise, it runs
unpatched (the old spin, nothing worse).

    python -m mlxpipe.launch.mlx_launch ARGS...   # the same ARGS as mlx.launch
"""

from __future__ import annotations

import select as _select_module
import sys
from collections.abc import Callable, Sequence
from typing import Any

# How the controller runs it: python -m LAUNCHER, then mlx.launch's own arguments.
LAUNCHER = "mlxpipe.launch.mlx_launch"
# The longest a controller's message waits in mlx.launch before it is written to a rank's standard input.
WRITE_POLL_S = 0.002

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


def patch(launch_module: Any) -> bool:
    """Make ``launch_module``'s I/O threads sleep; False (and nothing changed) if it is not laid out as expected."""
    if getattr(launch_module, "select", None) is not _select_module.select:
        return False
    if not hasattr(launch_module, "_launch_with_io"):
        return False
    launch_module.select = sleeping_select(_select_module.select)
    return True


def main() -> None:
    from mlx._distributed_utils import launch

    patch(launch)
    sys.argv[0] = "mlx.launch"
    sys.exit(launch.main())  # as mlx.launch's own console script ends


if __name__ == "__main__":
    main()
