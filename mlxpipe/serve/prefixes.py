"""Where a conversation's prefix is cached, as the router sees it (``serve --fleet``, an entry of several replicas).

A replica's prompt cache keeps the KV caches of the requests it served (in memory and on its disk tier), and a
conversation's next turn begins with its last turn's prompt, so it is prefilled fastest where that turn ran. The
router reads a request before any door has made its prompt, so it keys the request by its body's leading parts, in
the order the chat template lays them out: the system prompt, instructions and tools, then each message or input
item (a prompt's text: each ``PIECE`` characters). Each part's key hashes every part before it too (a chain), and
weighs the JSON of the parts up to it. A replica remembers the keys of the requests it was sent (``Prefixes``, the
latest ``MAX_KEYS``); a request's match on a replica is the weight of its longest chain that the replica remembers.

It is the router's record of what it sent where, not a view of the caches: a prefix the cache has since evicted
still counts, and two bodies laid out alike by the template but spelled otherwise (a string against a list of text
parts) do not match.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

MAX_KEYS = 4096  # per replica: the latest prefixes it was sent
PIECE = 256  # characters of a prompt's text per part
_HEAD = ("system", "instructions", "tools")  # laid out before the messages

Chain = list[tuple[bytes, int]]  # per leading part: its key (the parts up to it), the weight up to it


def chain(body: Mapping[str, Any]) -> Chain:
    """The keys of ``body``'s leading parts, each with the weight of the parts up to it."""
    parts: list[Any] = []
    head = {key: body[key] for key in _HEAD if body.get(key)}
    if head:
        parts.append(head)
    for key in ("messages", "input", "prompt"):
        value = body.get(key)
        if isinstance(value, str):
            parts += [value[i : i + PIECE] for i in range(0, len(value), PIECE)]
        elif isinstance(value, list):
            parts += value
    digest = hashlib.blake2b(digest_size=16)
    out: Chain = []
    weight = 0
    for part in parts:
        data = json.dumps(part, sort_keys=True, separators=(",", ":"), default=str).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
        weight += len(data)
        out.append((digest.digest(), weight))
    return out


class Prefixes:
    """The prefixes one replica was sent, the latest ``limit`` keys."""

    def __init__(self, limit: int = MAX_KEYS) -> None:
        self.limit = limit
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Chain) -> int:
        """The weight of the longest chain of ``keys`` held here (0: none)."""
        for key, weight in reversed(keys):
            if key in self._keys:
                return weight
        return 0

    def add(self, keys: Chain) -> None:
        for key, _ in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)
