"""The one check of each launch and batch value, named the caller's way.

A value is checked where its typed object is born: the command line's config names
the flag (``--decode-batch``), a message or job read on a rank names the field
(``decode_batch``). Both call the same function here, so one value has one rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxpipe.defaults import PIPELINE_MODES
from mlxpipe.errors import UsageError


def at_least(value: int, low: int, name: str) -> int:
    """``value`` when it is at least ``low``; else ``UsageError`` naming ``name``."""
    if value < low:
        raise UsageError(f"{name} must be at least {low}, got {value}")
    return value


def positive(value: float, name: str) -> float:
    """``value`` when it is above zero; else ``UsageError`` naming ``name``."""
    if not value > 0:
        raise UsageError(f"{name} must be positive, got {value:g}")
    return value


def one_of(value: str, choices: Sequence[str], name: str) -> str:
    """``value`` when it is one of ``choices``; else ``UsageError`` naming ``name``."""
    if value not in choices:
        raise UsageError(f"{name} {value!r}: use one of {', '.join(choices)}")
    return value


def check_mode(mode: str, name: str) -> str:
    """A pipeline mode: ``generic`` (mlxpipe's cut of any model) or ``native`` (the model's own ``pipeline()``)."""
    return one_of(mode, PIPELINE_MODES, name)

