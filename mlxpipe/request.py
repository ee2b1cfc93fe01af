"""A generation request's sampling options: one set of defaults and one validation.

Command-line flags, prompts-file lines and HTTP bodies all end up here, each
naming a field its own way (``--max-tokens``, ``'max_tokens'``,
``'max_completion_tokens'``): ``check_sampling`` says what is wrong with a
field, the caller says how its user spells it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mlxpipe.errors import UsageError

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Sampling:
    """mlx_lm.generate's knobs, by the same names."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    system_prompt: str | None = None
    ignore_chat_template: bool = False

    def check(self, name: Callable[[str], str] = lambda field: f"'{field}'") -> "Sampling":
        """This sampling, once every field is in range; raises ``RequestError`` naming the first that is not."""
        check_sampling(vars(self), name)
        return self


class RequestError(UsageError):
    """A request field out of range; ``field`` is its canonical name (``max_tokens``, ``temp``...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# field -> (is it in range, what the range is)
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "temp": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


def check_sampling(values: Mapping[str, Any], name: Callable[[str], str]) -> None:
    """Raise ``RequestError`` for the first of ``values``' sampling fields out of range; ``name`` spells it."""
    for field, (ok, expected) in _RANGES.items():
        value = values.get(field)
        if value is not None and not ok(value):
            raise RequestError(field, f"{name(field)} must be {expected}, got {value:g}")
