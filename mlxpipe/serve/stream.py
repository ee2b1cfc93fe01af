"""One request's stream between the queue's pump thread and the HTTP server's event loop: its tokens (plain ids,
or ``Sampled`` with log-probabilities), then its ``Outcome``. The queue (``serve.queue``) puts; a door reads
(``serve.generation``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from mlxpipe.errors import MlxpipeError
from mlxpipe.protocol.request import Request


@dataclass
class Outcome:
    """How a request ended, from rank 0's ``finished`` event (or a failure)."""

    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    error: MlxpipeError | None = None
    cache_tier: str | None = None  # where the cached tokens came from: "memory" or "disk"


@dataclass
class Resumed:
    """One resumption of a request whose ranks failed: the failure, the tokens prefilled again, the pause."""

    cause: str  # the failure's root cause (its host and rank)
    replayed: int  # the reply's tokens the client already had, prefilled again with the prompt
    failed_at: float  # time.monotonic() at the failure
    pause: float | None = None  # seconds from the failure to the first token after it (None: none yet)

    def describe(self) -> str:
        pause = f"paused {self.pause:.1f} s" if self.pause is not None else "no token since"
        return f"resumed after {self.cause}: {pause}, {self.replayed} tokens replayed"


@dataclass(frozen=True)
class Sampled:
    """A token with its log-probability and the top tokens' (``[id, logprob]``, best first), for a request that
    asked for logprobs; the others' tokens are plain ints."""

    token: int
    logprob: float
    top: list[list[float]]


class Stream:
    """The tokens of one request, readable from the HTTP server's event loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request  # as the ranks run it: its token ids (the chat template applied here), its options
        self._loop = loop
        self._queue: asyncio.Queue[int | Sampled | Outcome] = asyncio.Queue()
        self._peeked: list[int | Sampled | Outcome] = []
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.outcome: Outcome | None = None
        self.sent: list[int] = []  # the reply's token ids put so far: what a resumed request continues after
        self.resumed: list[Resumed] = []  # each time its ranks failed and it went on

    def put(self, item: int | Sampled | Outcome) -> None:
        """From the pump thread."""
        if not isinstance(item, Outcome):
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            self.sent.append(item.token if isinstance(item, Sampled) else item)
            if self.resumed and self.resumed[-1].pause is None:
                self.resumed[-1].pause = now - self.resumed[-1].failed_at
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the HTTP server has shut down: nobody reads this stream any more

    async def next(self) -> int | Sampled | Outcome:
        """The next token, or the outcome once the request has ended."""
        item = self._peeked.pop() if self._peeked else await self._queue.get()
        if isinstance(item, Outcome):
            self.outcome = item
        return item

    async def peek(self) -> int | Sampled | Outcome:
        """The first item ``next`` will give, without taking it."""
        if not self._peeked:
            self._peeked.append(await self._queue.get())
        return self._peeked[0]
