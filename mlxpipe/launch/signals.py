"""Signals to the controller: SIGINT, SIGTERM and SIGHUP become ``Interrupted``, so a command that started ranks
stops them on the way out and exits with 128 + the signal's number (``cli._errors.stop_on_signals``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType


class Interrupted(KeyboardInterrupt):
    """The controller received SIGINT, SIGTERM or SIGHUP; exit with ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextmanager
def interrupt_on_signals(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn the first of these signals into ``Interrupted``, so the ranks are stopped on the way out.

    Later ones are ignored while the ranks are being stopped. Only the main thread can
    set handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
