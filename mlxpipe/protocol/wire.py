"""The lines that carry messages and events between the controller and the ranks.

Two directions, both line-based so they survive ``mlx.launch`` and ``ssh -tt``:

* controller -> ranks: messages (``protocol.messages``) written to ``mlx.launch``'s
  standard input, which it broadcasts to every rank. A message is JSON,
  base64-encoded and cut into short lines (a pty in canonical mode truncates
  lines past 4095 bytes), ended by a line holding a single ``.``.
* ranks -> controller: events (``protocol.events``), one JSON object per stdout
  line behind the marker ``EVENT_PREFIX``. Everything else a rank prints is plain
  log output. The rank's supervisor sends them on as frames
  (``mlxpipe.launch.frames``), which survive ``mlx.launch`` cutting the ranks'
  lines and merging the pieces.

``encode`` and ``emit`` write the typed messages and events; the functions on
``Wire`` (JSON objects) are the framing beneath, for the relays that pass on what
they do not read (the supervisor, the frame reader) and for tests.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from mlxpipe.protocol.message import Event, Message, Wire

EVENT_PREFIX = "@@mlxpipe@@ "
_CHUNK = 1000
_END = "."
_EMIT_LOCK = threading.Lock()
# A rank's worker says it is alive to its supervisor (``launch/supervisor.py``), which keeps these lines to itself:
# from a thread of its own, so a long step says it too, while a stopped or hung process says nothing.
WORKER_BEAT_LINE = "@@mlxpipe-beat@@"
WORKER_BEAT_SECONDS = 1.0


def encode(message: Message) -> bytes:
    """One message as the lines a rank reads with ``read_request``."""
    return encode_request(message.to_wire())


def emit(event: Event, stream: IO[str] | None = None) -> None:
    """Write one event line and flush; safe from several threads."""
    emit_wire(event.to_wire(), stream)


def encode_request(data: Wire) -> bytes:
    """One JSON object as the lines ``read_request`` reads back."""
    text = base64.b64encode(json.dumps(data).encode()).decode()
    lines = [text[i : i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    return ("\n".join(lines + [_END]) + "\n").encode()


def read_request(stream: IO[str]) -> Wire | None:
    """The next JSON object written by ``encode_request`` on ``stream``; None at end of input."""
    parts: list[str] = []
    for line in stream:
        line = line.strip()
        if line == _END:
            data: Wire = json.loads(base64.b64decode("".join(parts)))
            return data
        if line:
            parts.append(line)
    return None


def emit_wire(data: Wire, stream: IO[str] | None = None) -> None:
    """Write one event line (``data`` behind ``EVENT_PREFIX``) and flush; safe from several threads."""
    out = stream or sys.stdout
    line = EVENT_PREFIX + json.dumps(data) + "\n"
    with _EMIT_LOCK:
        out.write(line)
        out.flush()


def start_beating(stream: IO[str] | None = None) -> None:
    """Write ``WORKER_BEAT_LINE`` every ``WORKER_BEAT_SECONDS`` from a daemon thread, for as long as the process
    runs. mlx computes and waits on the ring without Python's lock, so the thread beats through them."""

    def beat() -> None:
        out = stream or sys.stdout
        while True:
            with _EMIT_LOCK:
                out.write(WORKER_BEAT_LINE + "\n")
                out.flush()
            time.sleep(WORKER_BEAT_SECONDS)

    threading.Thread(target=beat, daemon=True, name="mlxpipe-beat").start()


def parse_event(line: str) -> Wire | None:
    """The event object on ``line``, or None when it is ordinary output."""
    line = line.rstrip("\r\n")
    at = line.find(EVENT_PREFIX)
    if at < 0:
        return None
    try:
        data: Any = json.loads(line[at + len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def iter_events(lines: Iterator[str]) -> Iterator[Wire]:
    """The event objects among ``lines``, skipping ordinary output."""
    for line in lines:
        event = parse_event(line)
        if event is not None:
            yield event
