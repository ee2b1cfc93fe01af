"""The download's progress on the terminal: one bar per host (bytes, rate, ETA), fed by the hosts' reports.

Used by ``mlxpipe download`` and by the download step of every launch (``launch.run``); drawn through
the console's stderr, so ``console`` itself knows no command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mlxpipe import console

if TYPE_CHECKING:
    from mlxpipe.download.controller import HostReport, HostTask


@contextmanager
def download_progress(
    tasks: Sequence[HostTask], enabled: bool = True
) -> Iterator[Callable[[HostReport], None] | None]:
    """One Rich progress bar per host (bytes, rate, ETA); yields the update callback.

    A bar counts only what moves: files a host already holds shrink its total.
    Hosts not in ``tasks`` (the controller's own cache) get a bar on their first update.
    Drawn only on a terminal: in a log, the table that follows says it all.
    """
    if not enabled or not console.err.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(), console=console.err,
    )
    ids = {id(t): progress.add_task(t.label, total=t.total_bytes) for t in tasks}

    def update(report: HostReport) -> None:
        key = id(report.task)
        if key not in ids:
            ids[key] = progress.add_task(report.task.label, total=report.todo_bytes)
        progress.update(ids[key], completed=max(report.done_bytes, 0), total=report.todo_bytes)

    with progress:
        yield update
