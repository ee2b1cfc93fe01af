"""The wire format between the controller and the ranks.

Two directions, both line-based so they survive ``mlx.launch`` and ``ssh -tt``:

* controller -> ranks: requests written to ``mlx.launch``'s standard input,
  which it broadcasts to every rank. A request is JSON, base64-encoded and cut
  into short lines (a pty in canonical mode truncates lines past 4095 bytes),
  ended by a line holding a single ``.``.
* ranks -> controller: events, one JSON object per stdout line behind the
  marker ``EVENT_PREFIX``. Everything else a rank prints is plain log output.
  The rank's supervisor sends them on as frames (``mlxpipe.launch.frames``), which
  survive ``mlx.launch`` cutting the ranks' lines and merging the pieces.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from typing import IO, Any, Iterator

EVENT_PREFIX = "@@mlxpipe@@ "
_CHUNK = 1000
_END = "."
_EMIT_LOCK = threading.Lock()


def encode_request(request: dict[str, Any]) -> bytes:
    """Encode one request as the lines a rank reads with ``read_request``."""
    data = base64.b64encode(json.dumps(request).encode()).decode()
    lines = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)]
    return ("\n".join(lines + [_END]) + "\n").encode()


def read_request(stream: IO[str]) -> dict[str, Any] | None:
    """Read the next request from ``stream``; None at end of input."""
    parts: list[str] = []
    for line in stream:
        line = line.strip()
        if line == _END:
            return json.loads(base64.b64decode("".join(parts)))
        if line:
            parts.append(line)
    return None


def emit(event: str, stream: IO[str] | None = None, **fields: Any) -> None:
    """Write one event line (``{"event": event, **fields}``) and flush; safe from several threads."""
    out = stream or sys.stdout
    line = EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n"
    with _EMIT_LOCK:
        out.write(line)
        out.flush()


def parse_event(line: str) -> dict[str, Any] | None:
    """The event on ``line``, or None when it is ordinary output."""
    line = line.rstrip("\r\n")
    at = line.find(EVENT_PREFIX)
    if at < 0:
        return None
    try:
        return json.loads(line[at + len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None


def iter_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The events among ``lines``, skipping ordinary output."""
    for line in lines:
        event = parse_event(line)
        if event is not None:
            yield event
