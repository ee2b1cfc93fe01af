"""What a rank receives on standard input, numbered in arrival order.

``mlx.launch`` broadcasts the controller's standard input to every rank, so
every rank receives the same messages in the same order, but each at its own
moment. A reader thread numbers them as they arrive; the request loop takes
them in order. While requests are being served the ranks agree, through a
collective, how many messages all of them hold
(``generation.engine.Engine._share``), and apply exactly those: never a
message one rank has and another has not yet read.
"""

from __future__ import annotations

import threading
from typing import IO

from mlxpipe.protocol import wire
from mlxpipe.protocol.message import Message, Wire
from mlxpipe.protocol.messages import MESSAGES


class Inbox:
    """The messages read from ``stream`` by a background thread; None marks the end of input.

    They are read as JSON by the thread and made typed messages as the request loop takes them, so a
    message this worker refuses fails the loop (on every rank alike), not the reader."""

    def __init__(self, stream: IO[str]) -> None:
        self._messages: list[Wire | None] = []
        self._changed = threading.Condition()
        self.consumed = 0  # messages taken by the request loop
        threading.Thread(target=self._read, args=(stream,), daemon=True, name="mlxpipe-inbox").start()

    @property
    def received(self) -> int:
        """How many messages have arrived (the end of input counts as one)."""
        with self._changed:
            return len(self._messages)

    def next(self) -> Message | None:
        """The next message, waiting for it; None at the end of input."""
        self.wait_beyond(self.consumed)
        return self.take(self.consumed + 1)[0]

    def take(self, upto: int) -> list[Message | None]:
        """The messages from the last one taken up to ``upto`` (already received), in order."""
        with self._changed:
            taken = self._messages[self.consumed : upto]
        self.consumed = max(self.consumed, upto)
        return [None if data is None else MESSAGES.from_wire(data) for data in taken]

    def wait_beyond(self, count: int) -> None:
        """Block until more than ``count`` messages have arrived."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._messages) > count)

    def _read(self, stream: IO[str]) -> None:
        while True:
            message = wire.read_request(stream)
            with self._changed:
                self._messages.append(message)
                self._changed.notify_all()
            if message is None:
                return
