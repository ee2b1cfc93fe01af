"""A decode step built one tick ahead, on an engine of one stage (pure tensor parallelism).

mlx-lm's ``generate_step`` hides the host's share of each token (building the
next step's graph in Python: about 2.5 ms a token for a 20-layer model here,
a twentieth of a tensor-parallel token) behind the step the machine is
computing: it schedules step n + 1 (``mx.async_eval``) on step n's lazy token
before it reads that token. The engine's ticks read every token before they
build the next micro-batch, so on one stage, where nothing else overlaps, it
pays that time on every token. Here it does as ``generate_step`` does, where
that cannot change what is computed:

* the decode step's token, and the per-tick collective that gives every rank
  rank 0's tokens (and the ranks' agreed message counts), stay lazy: the next
  step of the same group runs on that lazy token, scheduled before this one is
  read;
* only for requests whose sampling has no host-side state (greedy, without
  logits processors, a grammar or log-probabilities: their token is a lazy
  ``argmax``), with caches that can step back (``KVCache``,
  ``BatchKVCache``), and when the group holds every running request and no
  waiting request has a free slot (so the schedule will run that group next);
* when the schedule runs something else next (a member ended, a request
  arrived or was cancelled), the step run ahead is taken back: its caches trim
  the token it added (``trim(1)``), as mlx-lm trims a rejected draft token,
  before anything reads or stores them. Its collective ran on every rank alike
  (every rank takes the same decisions, from the shared schedule), so the
  ranks' exchanges stay in step.

``Lookahead`` runs those steps for the engine: which requests stay lazy, the
step built ahead, and how many were used or taken back (``batch_done``'s
``run_ahead``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxpipe.worker.agree import read_tick, tick_tokens
from mlxpipe.worker.generation.schedule import MicroBatch, Schedule
from mlxpipe.worker.inbox import Inbox

if TYPE_CHECKING:
    from mlxpipe.protocol.request import Request
    from mlxpipe.worker.generation.sampling import Samplers

# The engine's per-tick collective, lazy: rank 0's sampled tokens (None elsewhere), their rows, the inbox whose
# message count the ranks agree on (``Engine._shared``, ``agree.tick_collective``).
Collective = Callable[[mx.array | None, int, Inbox | None], mx.array]

_STEPS_BACK = (KVCache, BatchKVCache)  # caches whose trim(1) takes the last token back exactly


@dataclass
class RunAhead:
    """A decode step of ``requests`` (the group ``group``) scheduled before the previous one was read."""

    requests: tuple[int, ...]
    group: int | None
    shared: mx.array  # its per-tick collective, lazy: rank 0's tokens (and the agreed message counts)
    cache: list[Any]  # the caches it wrote its token into

    def runs(self, batch: MicroBatch | None) -> bool:
        """Whether ``batch`` (what the schedule runs at this tick) is this step."""
        return batch is not None and batch.samples and batch.requests == self.requests and batch.group == self.group

    def undo(self) -> None:
        """Take the step back: every cache forgets the token it added."""
        for c in self.cache:
            c.trim(1)


def lazy_sampling(request: Request, has_processors: bool) -> bool:
    """Whether ``request``'s token can stay lazy: greedy, no logits processors, grammar or log-probabilities."""
    return (request.temp == 0 and not has_processors and not request.constrained
            and not request.logprobs and request.kv_bits is None)


def may_run_ahead(schedule: Schedule, batch: MicroBatch, cache: list[Any]) -> bool:
    """Whether the step after ``batch`` (a decode step of lazy-sampled requests) is worth building now:
    the schedule runs this group next unless a member ends on an end-of-sequence token or a message
    arrives, and its caches can step back."""
    members = set(batch.requests)
    for index in batch.requests:
        if schedule.end_reason(schedule.requests[index], None) is not None:
            return False  # it ends with this token, whatever its value: nothing follows
    # A request waiting for a free slot starts next (a slot frees only when a member ends: taken back then).
    return schedule.in_slots == members and not schedule.admits_next and all(type(c) in _STEPS_BACK for c in cache)


class Lookahead:
    """An engine's decode steps whose tokens stay lazy, each next step built before this one is read (see the
    module docstring)."""

    def __init__(self, model: nn.Module, schedule: Schedule, lazy: bool, samples: bool, sampling: Samplers,
                 collective: Collective) -> None:
        """``lazy``: tokens may stay lazy at all (one stage, no position ids to carry); ``samples``: this rank
        samples, with ``sampling`` (rank 0's samplers); ``collective``: the engine's per-tick one."""
        self.model, self.schedule = model, schedule
        self.enabled, self.samples, self.sampling = lazy, samples, sampling
        self.collective = collective
        self.lazy: set[int] = set()  # the requests whose token can stay lazy
        self.ahead: RunAhead | None = None
        self.counts = {"used": 0, "taken_back": 0}  # steps run ahead: read at the next tick, or undone

    def admit(self, index: int, request: Request, has_processors: bool) -> None:
        """A request starts: its token stays lazy where its sampling allows it."""
        if self.enabled and lazy_sampling(request, has_processors):
            self.lazy.add(index)

    def check(self, batch: MicroBatch | None) -> None:
        """The tick runs ``batch``: a step run ahead that is not it is taken back."""
        if self.ahead is not None and not self.ahead.runs(batch):
            self._take_back()

    def forget(self, index: int) -> None:
        """A request ended: a step run ahead for it is taken back."""
        if self.ahead is not None and index in self.ahead.requests:
            self._take_back()
        self.lazy.discard(index)

    def runs_lazily(self, batch: MicroBatch) -> bool:
        """Whether ``batch`` is a decode step of one stage whose every token can stay lazy."""
        return self.enabled and batch.samples and all(i in self.lazy for i in batch.requests)

    def run(self, batch: MicroBatch, cache: list[Any], inbox: Inbox | None) -> tuple[list[int], int]:
        """A lazily sampled decode step, on its caches (its token read once the next step is scheduled): rank 0's
        tokens and the message count every rank has, as ``agree.read_tick`` reads them."""
        rows = len(batch.requests)
        if self.ahead is not None:  # built at the last tick: it is this batch (checked as the tick began)
            shared, self.ahead = self.ahead.shared, None
            self.counts["used"] += 1
        else:
            shared = self._step(batch, mx.array(batch.rows), cache, inbox)
        if may_run_ahead(self.schedule, batch, cache):
            inputs = tick_tokens(shared, rows, inbox is not None).reshape(rows, 1)
            self.ahead = RunAhead(batch.requests, batch.group, self._step(batch, inputs, cache, inbox), cache)
        return read_tick(shared, rows, inbox is not None)

    def _step(self, batch: MicroBatch, inputs: mx.array, cache: list[Any], inbox: Inbox | None) -> mx.array:
        """One decode step on ``inputs``, scheduled: its lazy per-tick collective."""
        logits = self.model(inputs, cache=cache)[:, -1, :]
        sampled = None
        if self.samples:
            sampled = self.sampling.lazy(batch.requests, logits)
        shared = self.collective(sampled, len(batch.requests), inbox)
        # logits too: another member's share of the gathered vocabulary head runs even though it reads nothing
        mx.async_eval(shared, logits)
        return shared

    def _take_back(self) -> None:
        """The schedule runs something else: the step run ahead is undone before its caches are used."""
        assert self.ahead is not None
        self.ahead.undo()
        self.ahead = None
        self.counts["taken_back"] += 1
