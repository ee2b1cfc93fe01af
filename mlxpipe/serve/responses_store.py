"""The responses ``previous_response_id`` can name: a bounded, in-memory store.

A stored response keeps its conversation as chat messages (its input, the input of the responses it followed,
and its own output), so a follow-up is that conversation plus its new input: the same tokens as before, then the
new turn, and the ranks' prompt cache (mlx-lm's ``LRUPromptCache``) prefills only the new turn. The store holds
at most ``DEFAULT_CAPACITY`` responses and ``DEFAULT_MAX_BYTES`` of them (as JSON; the least recently used goes
first) for at most ``DEFAULT_TTL_SECONDS`` each; it lives in the server process and ends with it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 256
DEFAULT_TTL_SECONDS = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # long agent conversations, 256 of them, stay far below


@dataclass(frozen=True)
class Stored:
    """One stored response: its conversation (chat messages, without instructions) and its body."""

    messages: list[dict[str, Any]]
    body: dict[str, Any]
    expires: float
    size: int  # bytes, as JSON


class ResponseStore:
    """At most ``capacity`` responses and ``max_bytes`` of them, each for ``ttl`` seconds; ``clock`` is passed in
    to be tested."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, ttl: float = DEFAULT_TTL_SECONDS,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.ttl, self.max_bytes, self._clock = capacity, ttl, max_bytes, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        """Keep a response (the least recently used go while the store is over its bounds)."""
        self.delete(response_id)
        size = len(json.dumps(messages)) + len(json.dumps(body))
        self._items[response_id] = Stored(messages, body, self._clock() + self.ttl, size)
        self._bytes += size
        while len(self._items) > self.capacity or (self._bytes > self.max_bytes and len(self._items) > 1):
            self._bytes -= self._items.popitem(last=False)[1].size

    def get(self, response_id: str) -> Stored | None:
        """A response still kept, or None (never stored, expired or pushed out)."""
        stored = self._items.get(response_id)
        if stored is None:
            return None
        if stored.expires <= self._clock():
            self.delete(response_id)
            return None
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not kept."""
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._bytes -= stored.size
        return True

    def __len__(self) -> int:
        return len(self._items)
