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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxpipe.worker.generation.schedule import MicroBatch, Schedule

if TYPE_CHECKING:
    from mlxpipe.protocol.request import Request

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
