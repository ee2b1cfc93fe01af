"""The command line's one error boundary: known errors become one line plus a hint and an exit code.

Exit codes: 0 success, 1 failure (a failed rank included), 2 usage error, 128 + the signal when
interrupted (130, 143, 129). ``--debug`` (``MLXPIPE_DEBUG``) keeps the tracebacks instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from mlxpipe import console
from mlxpipe.errors import MlxpipeError, UsageError

P = ParamSpec("P")
R = TypeVar("R")

DEBUG_ENV = "MLXPIPE_DEBUG"


def set_debug(debug: bool) -> None:
    """``--debug``: let every error through with its traceback."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


def boundary(fn: Callable[P, R]) -> Callable[P, R]:
    """The one error boundary: known errors -> one line + hint + exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MlxpipeError as e:
            if os.environ.get(DEBUG_ENV):
                raise
            console.error(e.message, e.hint)
            raise typer.Exit(2 if isinstance(e, UsageError) else 1) from None
        except Exception as e:
            # A hub or network error that reached here unmapped (hub.faults.hub_errors maps them
            # where the hub is called) is still the user's network, not a bug: one line, exit 1.
            from mlxpipe.hub.faults import as_hub_error

            known = None if os.environ.get(DEBUG_ENV) else as_hub_error(e)
            if known is None:
                raise
            console.error(known.message, known.hint)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def stop_on_signals(fn: Callable[P, R]) -> Callable[P, R]:
    """SIGINT, SIGTERM and SIGHUP stop every rank on the way out; exit 128 + the signal (130, 143, 129)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from mlxpipe.launch.signals import Interrupted, interrupt_on_signals

        try:
            with interrupt_on_signals():
                return fn(*args, **kwargs)
        except Interrupted as e:
            console.error(f"interrupted by {e.name}")
            raise typer.Exit(e.exit_status) from None

    return wrapper
