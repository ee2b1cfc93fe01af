"""The one place mlxpipe writes to the terminal.

Library modules never print: they return values or raise ``MlxpipeError``.
Commands render through here: Rich on stdout for people, plain JSON for
scripts (``--json``), and errors on stderr.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

# Piped output is not squeezed into 80 columns: tables stay readable in logs.
_PIPE_WIDTH = 132
out = Console(highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else _PIPE_WIDTH)


def print_json(data: Any) -> None:
    """Machine-readable output: exactly one JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def error(message: str, hint: str | None = None) -> None:
    """One line saying what is wrong, and one saying what to do."""
    # soft_wrap: an error stays one line however long its path, so it can be grepped.
    err.print(f"[bold red]error:[/] {_escape(message)}", soft_wrap=True)
    if hint:
        err.print(f"[dim]hint:[/] {_escape(hint)}", soft_wrap=True)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {_escape(message)}", soft_wrap=True)


def note(message: str, style: str = "dim") -> None:
    """One line of a server's log (a request's outcome), never wrapped, so that it can be grepped."""
    err.print(f"[{style}]{_escape(message)}[/]", soft_wrap=True)


def human_bytes(n: int | float | None, *, compact: bool = False) -> str:
    """Binary sizes: ``1536`` -> ``"1.5 KiB"``; compact for tables: ``"2K"``, ``"47.6G"``; None -> ``"-"``."""
    if n is None:
        return "-"
    units = ("B", "K", "M", "G", "T") if compact else ("B", "KiB", "MiB", "GiB", "TiB")
    whole = units[:2] if compact else units[:1]  # shown without decimals
    sep = "" if compact else " "
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in units:
        if n < 1024 or unit == units[-1]:
            break
        n /= 1024
    return f"{sign}{n:.0f}{sep}{unit}" if unit in whole else f"{sign}{n:.1f}{sep}{unit}"


def short_bytes(n: int | float | None) -> str:
    """``human_bytes`` for table cells."""
    return human_bytes(n, compact=True)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


class ProgressCallback:
    """A transient Rich progress bar fed by ``(done, total)`` calls; silent when disabled."""

    def __init__(self, description: str, enabled: bool = True) -> None:
        self.description = description
        self.enabled = enabled and err.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressCallback:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                console=err, transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=None)
        return self

    def __call__(self, done: int, total: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
