"""What the download script on a host (``python -m mlxpipe.download.fetch``) tells the controller.

It runs with mlxpipe installed on that host (it uses the hub client and the cache
layout), so it imports this contract like the ranks do; its events are a stream of
their own (``FETCH_EVENTS``): its ``progress`` and ``done`` are not a rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxpipe.protocol.message import Event, Registry


@dataclass(frozen=True)
class FetchError(Event):
    """The fetch failed: what, and what to do."""

    TAG = "error"
    message: str
    hint: str | None = None


@dataclass(frozen=True)
class Check(Event):
    """``--check``: which of the job's files the host already holds."""

    TAG = "check"
    present: list[str]
    missing: list[str]


@dataclass(frozen=True)
class Fetching(Event):
    """Bytes fetched since the last one (negative: an attempt's bytes given back, as it is retried)."""

    TAG = "progress"
    bytes: int


@dataclass(frozen=True)
class FileDone(Event):
    """One file is on the host: ``status`` present (it was already) or fetched."""

    TAG = "file"
    name: str
    status: str
    bytes: int


@dataclass(frozen=True)
class FetchResult(Event):
    """What one host holds after a fetch (or a copy from the controller): the fetch's last event."""

    TAG = "done"
    host: str
    path: str
    fetched_bytes: int
    present_bytes: int
    fetched_files: tuple[str, ...]
    present_files: tuple[str, ...]

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> FetchResult:
        return cls(**{**values, "fetched_files": tuple(values["fetched_files"]),
                      "present_files": tuple(values["present_files"])})


FETCH_EVENTS: Registry[Event] = Registry(FetchError, Check, Fetching, FileDone, FetchResult)
