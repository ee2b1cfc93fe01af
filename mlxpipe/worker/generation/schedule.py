"""The lockstep schedule of overlapped requests: what each pipeline stage runs at each tick.

Pure Python and deterministic: every rank builds the same ``Schedule`` from the
same broadcast requests and the same shared tokens, so each rank knows without
asking what its neighbours send and receive, and when a request ends.

Stages count from the first (the highest rank, which embeds) to the last
(rank 0, which samples). A micro-batch that enters stage 0 at tick t is at
stage s at tick t + s. Each request runs as mlx-lm's ``generate_step`` would:
prefill chunks of ``prefill_step`` tokens (all but the prompt's last token),
then single tokens, each sampling the next one. A request's prefill chunks may
follow each other on consecutive ticks (nothing waits for them), but a token
can only enter once the one before it has been sampled at the last stage, so
with ``slots`` (the concurrency) at least the number of stages, every stage is
busy with a different request at every tick.

Decode steps travel in *groups* of up to ``decode_batch`` requests: one
micro-batch carries one token of every member, and the members' caches are
one batched cache on every stage (mlx-lm's ``BatchKVCache``). A request joins a
group with its last prompt token, once its prefill chunks (one request per
micro-batch) have entered; it leaves when it ends. Overlap comes first, then
batching: with D requests decoding on N stages there are ``min(D, N)`` groups
(more only when ``decode_batch`` caps their size), as even as can be, so two
requests on two stages decode in two micro-batches that compute at once, never
in one while a stage idles. When requests end or arrive, a group that has
grown too large sheds its last members as it next enters (they join another
group, or open one, at the next tick), and a new request joins the next group
with room to enter. With ``decode_batch`` 1 every request is its own group.

While any request decodes, another's prefill chunks hold at most ``prefill_budget``
tokens (when set): a tick runs one micro-batch per stage, and a decoding request
gets one token per tick it enters, so a chunk of ``prefill_step`` tokens would
stretch every decoding stream's time between tokens to that chunk's compute, for
the whole prefill (vLLM's and SGLang's chunked prefill bound it the same way, by
a token budget per step). Alone, a prefill runs in chunks of ``prefill_step``.

Requests may join at any tick (``add``), in the order every rank applies them,
and leave early (``cancel``): a cancelled request stops entering at once and
frees its slot once its last micro-batch has left the last stage, so no stage
ever runs a micro-batch whose caches are gone.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

_NEVER = 1 << 62  # ready_at of a request waiting for its token
FAILED = -2  # the token rank 0 shares for a request whose sampling failed: it ends with "error"


@dataclass(frozen=True)
class MicroBatch:
    """What one tick feeds to the first stage: one row of tokens per request.

    A prefill chunk is one request's row (``group`` None); a decode step is a
    group's rows, one token each, in the order of the group's batched caches.
    """

    requests: tuple[int, ...]  # indices in the batch, one per row
    rows: tuple[tuple[int, ...], ...]  # each row's tokens; every row has the same length
    samples: bool  # the last stage samples each row's next token
    group: int | None = None
    # Where each row's first token stands in its request's sequence (prompt, then reply): a vision model's
    # first stage reads the prompt's embeddings and position ids there.
    starts: tuple[int, ...] = ()

    @property
    def request(self) -> int:
        """The request of a one-row micro-batch (a prefill chunk)."""
        if len(self.requests) != 1:
            raise ValueError("a micro-batch of several requests has no single request")
        return self.requests[0]

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens of a one-row micro-batch."""
        return self.rows[self.requests.index(self.request)]

    @property
    def width(self) -> int:
        """Tokens per row."""
        return len(self.rows[0])


@dataclass
class Group:
    """Requests whose decode steps travel as one micro-batch."""

    id: int
    members: list[int] = field(default_factory=list)  # request indices, in the batched caches' row order
    ready_at: int = 0
    key: Hashable = None  # its members' ``batch_key``


@dataclass
class RequestState:
    """Where one request of the batch stands."""

    index: int
    prompt: Sequence[int]
    max_tokens: int
    slot: int | None = None
    fed: int = 0  # prompt tokens already fed to the first stage
    ready_at: int = _NEVER  # first tick it may enter again
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end of sequence), "length", "cancelled" or "error"
    admitted_tick: int | None = None
    finished_tick: int | None = None
    cached: int = 0  # prompt tokens already in the request's caches when it arrived
    fed_tokens: list[int] = field(default_factory=list)  # every token fed to the first stage, cached ones first
    cancelled: bool = False
    extra_eos: frozenset[int] = frozenset()  # its own end-of-sequence ids (--extra-eos-token)
    group: int | None = None  # the decode group it belongs to, once it joined one
    # Requests share a decode group only with equal keys (caches of one kind); None: a group of its own.
    batch_key: Hashable = ()

    @property
    def running(self) -> bool:
        return self.slot is not None and self.finish_reason is None


class Schedule:
    """Which micro-batch each stage runs at each tick, for one batch of requests."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        *,
        stages: int,
        slots: int,
        prefill_step: int,
        eos_ids: Collection[int],
        decode_batch: int = 1,
        prefill_budget: int | None = None,
    ) -> None:
        if len(prompts) != len(max_tokens):
            raise ValueError("one max_tokens per prompt")
        if stages < 1 or slots < 1 or prefill_step < 1 or decode_batch < 1:
            raise ValueError("stages, slots, prefill_step and decode_batch must be positive")
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError("prefill_budget must be positive (or None: none)")
        self.requests: list[RequestState] = []
        for prompt, most in zip(prompts, max_tokens, strict=True):
            self.add(prompt, most)
        self.stages = stages
        self.slots: list[int | None] = [None] * slots  # slot -> request index
        self.prefill_step = prefill_step
        self.prefill_budget = prefill_budget  # a prefill chunk's tokens while another request decodes (None: any)
        self.eos_ids = frozenset(eos_ids)
        self.decode_batch = decode_batch
        self.max_groups = max(stages, math.ceil(slots / decode_batch))
        self.groups: dict[int, Group] = {}
        self.tick = -1
        self.ended: list[int] = []
        self.ended_groups: list[int] = []  # groups that ended at this tick: no stage runs them again
        self._next_group = 0
        self._pending = 0  # the next request to admit
        self._entries: dict[int, MicroBatch] = {}  # tick -> what entered stage 0 then

    @property
    def done(self) -> bool:
        """Every request has finished."""
        return all(r.finish_reason is not None for r in self.requests)

    @property
    def idle(self) -> bool:
        """Nothing waits or runs (a request ends only once its last micro-batch left): a tick would do nothing."""
        return self.done

    def add(self, prompt: Sequence[int], max_tokens: int, cached: int = 0, extra_eos: Collection[int] = (),
            batch_key: Hashable = ()) -> int:
        """Queue a request whose first ``cached`` prompt tokens are already in its caches; its index.

        ``extra_eos``: ids that end this request besides the schedule's ``eos_ids``.
        ``batch_key``: requests share a decode group only with equal keys (their
        caches must merge); None keeps the request in a group of its own.
        """
        if len(prompt) == 0 or max_tokens < 1:
            raise ValueError("every request needs a prompt token and max_tokens >= 1")
        if not 0 <= cached < len(prompt):
            raise ValueError("at least one prompt token must be fed")
        request = RequestState(len(self.requests), prompt, max_tokens, fed=cached, cached=cached,
                               extra_eos=frozenset(extra_eos), batch_key=batch_key)
        request.fed_tokens = list(prompt[:cached])
        self.requests.append(request)
        return request.index

    def add_failed(self) -> int:
        """A request refused before it started (every rank refuses it alike): it has ended, with "error"."""
        request = RequestState(len(self.requests), (), 0, finish_reason="error", finished_tick=self.tick)
        self.requests.append(request)
        return request.index

    def cancel(self, index: int) -> bool:
        """Stop a request; True when it finished at once (it had not started), else it ends within a few ticks."""
        request = self.requests[index]
        if request.finish_reason is not None or request.cancelled:
            return False
        request.cancelled = True
        request.ready_at = _NEVER
        if request.slot is None:
            request.finish_reason = "cancelled"
            request.finished_tick = self.tick
            return True
        return False

    def begin_tick(self) -> list[int]:
        """Start the next tick: free the slots of cancelled requests, admit requests into free slots,
        pick what enters stage 0.

        Returns the requests admitted at this tick; ``ended`` those that ended
        at its start (cancelled, their last micro-batch gone).
        """
        self.tick += 1
        self._entries.pop(self.tick - self.stages, None)
        in_flight = {index for entry in self._entries.values() for index in entry.requests}
        self.ended = [r.index for r in self._running() if r.cancelled and r.index not in in_flight]
        for index in self.ended:
            self._free(self.requests[index], "cancelled")
        admitted = []
        for slot, holder in enumerate(self.slots):
            while self._pending < len(self.requests) and self.requests[self._pending].finish_reason is not None:
                self._pending += 1  # cancelled while waiting, or refused: it already ended
            if holder is None and self._pending < len(self.requests):
                request = self.requests[self._pending]
                request.slot, request.ready_at, request.admitted_tick = slot, self.tick, self.tick
                self.slots[slot] = request.index
                admitted.append(request.index)
                self._pending += 1
        self._drop_empty_groups()
        entry = self._choose()
        if entry is not None:
            self._entries[self.tick] = entry
        return admitted

    def _choose(self) -> MicroBatch | None:
        """What enters stage 0 now: whatever has waited longest (prefill chunk or group), slot order breaking ties."""
        candidates: list[tuple[tuple[int, int], RequestState | Group]] = []
        joiners = []
        for r in self._running():
            if r.ready_at > self.tick or r.cancelled:
                continue
            if len(r.prompt) - r.fed > 1:
                candidates.append(((r.ready_at, r.slot or 0), r))
            elif r.group is None:
                joiners.append(r)
        joiners.sort(key=lambda r: (r.ready_at, r.slot))
        for g in self.groups.values():
            if g.ready_at <= self.tick:
                candidates.append(((g.ready_at, min(self.requests[m].slot or 0 for m in g.members)), g))
        wanted, size = self._group_shape(len(joiners))
        if joiners and len(self.groups) < wanted:
            first = joiners[0]
            candidates.append(((first.ready_at, first.slot or 0), Group(-1)))  # a group yet to open
        if not candidates:
            return None
        _, chosen = min(candidates, key=lambda c: c[0])
        if isinstance(chosen, RequestState):
            return self._next_micro_batch(chosen)
        if chosen.id < 0:
            chosen = Group(self._next_group, key=joiners[0].batch_key)
            self.groups[chosen.id] = chosen
            self._next_group += 1
        elif len(self.groups) < wanted:
            joiners = []  # they open the groups still missing; this one sheds what they will need
        return self._enter_group(chosen, joiners, size)

    def _group_shape(self, joiners: int) -> tuple[int, int]:
        """How many decode groups there should be, and how many requests the group entering now may hold.

        With D requests decoding (in groups, or waiting to join one) on N stages: ``min(D, N)``
        groups, or as many as ``decode_batch`` makes necessary, as even as can be. While groups
        are missing, one that enters keeps ``D // groups`` of its members (the rest open the
        missing groups); otherwise it holds up to ``ceil(D / groups)``.
        """
        decoding = joiners + sum(len(g.members) for g in self.groups.values())
        wanted = min(self.max_groups, max(min(decoding, self.stages), math.ceil(decoding / self.decode_batch)))
        if not wanted:
            return 0, self.decode_batch
        if len(self.groups) < wanted:
            return wanted, max(1, decoding // wanted)
        return wanted, min(self.decode_batch, math.ceil(decoding / wanted))

    def _enter_group(self, group: Group, joiners: list[RequestState], size: int) -> MicroBatch:
        """The group's next decode step: members beyond ``size`` leave it (to join or open another group at
        the next tick), waiting requests join while it has room."""
        while len(group.members) > size:
            moved = self.requests[group.members.pop()]
            moved.group, moved.ready_at = None, self.tick + 1
        for r in joiners:
            full = len(group.members) >= size
            alone = group.key is None and group.members
            if full or alone:
                break
            if r.batch_key != group.key:
                continue
            group.members.append(r.index)
            r.group = group.id
        rows, starts = [], []
        for index in group.members:
            entry = self._next_micro_batch(self.requests[index])
            rows.append(entry.rows[0])
            starts.append(entry.starts[0])
        group.ready_at = _NEVER
        return MicroBatch(tuple(group.members), tuple(rows), samples=True, group=group.id, starts=tuple(starts))

    def _drop_empty_groups(self) -> None:
        self.ended_groups = [g for g, group in self.groups.items() if not group.members]
        for g in self.ended_groups:
            del self.groups[g]

    def at(self, stage: int) -> MicroBatch | None:
        """What ``stage`` runs at this tick."""
        return self._entries.get(self.tick - stage)

    def next_at(self, stage: int) -> MicroBatch | None:
        """What ``stage`` (not the first) runs at the next tick: already decided now."""
        if stage < 1:
            raise ValueError("the first stage's next micro-batch is not decided yet")
        return self._entries.get(self.tick + 1 - stage)

    @property
    def sampling(self) -> MicroBatch | None:
        """The micro-batch from which the last stage samples tokens at this tick, if any."""
        last = self.at(self.stages - 1)
        return last if last is not None and last.samples else None

    def end_tick(self, tokens: Sequence[int] | None) -> list[int]:
        """End the tick with the tokens sampled at it, one per row (if any); the requests that finished."""
        sampled = self.sampling
        if (sampled is None) != (tokens is None):
            raise ValueError(f"tick {self.tick}: a token {'was' if sampled else 'was not'} expected")
        if sampled is None or tokens is None:
            return []
        if len(tokens) != len(sampled.requests):
            raise ValueError(f"tick {self.tick}: {len(sampled.requests)} tokens expected, got {len(tokens)}")
        finished = []
        for index, token in zip(sampled.requests, tokens, strict=True):
            request = self.requests[index]
            if request.finish_reason is not None:
                continue  # already ended (cancelled and freed)
            reason = self.end_reason(request, token)
            if reason not in ("cancelled", "error"):  # a cancelled request's token is dropped: nobody waits for it
                request.generated.append(token)
            if reason is None:
                request.ready_at = self.tick + 1
                continue
            self._free(request, reason)
            finished.append(index)
        if sampled.group is not None and sampled.group in self.groups:
            self.groups[sampled.group].ready_at = self.tick + 1
        return finished

    def end_reason(self, request: RequestState, token: int | None) -> str | None:
        """Why ``request`` ends with ``token``, the token sampled for it now (not yet in its ``generated``), or None
        while it goes on: the one place that decides when a generation stops.

        "cancelled": it was cancelled (its token is dropped); "error": its sampling failed on rank 0 (``FAILED``;
        the others go on); "stop": an end-of-sequence id, the schedule's or the request's own; "length": its
        ``max_tokens``-th token. ``token`` None is a token not read yet (a decode step built a tick ahead on a lazy
        one, ``ahead``): whatever does not depend on its value. ``streamed`` requests end by the same rules in
        mlx-lm's ``stream_generate`` (the tokenizer's end-of-sequence ids with the request's own added, and
        ``max_tokens``).
        """
        if request.cancelled:
            return "cancelled"
        if token == FAILED:
            return "error"
        if token is not None and (token in self.eos_ids or token in request.extra_eos):
            return "stop"
        if len(request.generated) + 1 >= request.max_tokens:
            return "length"
        return None

    def _free(self, request: RequestState, reason: str) -> None:
        assert request.slot is not None
        self.slots[request.slot] = None
        request.finish_reason = reason
        request.finished_tick = self.tick
        if request.group is not None and request.group in self.groups:
            self.groups[request.group].members.remove(request.index)

    def _running(self) -> list[RequestState]:
        return [self.requests[i] for i in self.slots if i is not None]

    @property
    def in_slots(self) -> set[int]:
        """The requests holding a slot (running, or cancelled with a micro-batch still in flight)."""
        return {i for i in self.slots if i is not None}

    @property
    def admits_next(self) -> bool:
        """Whether a request waits for a slot and one is free: the next tick admits it."""
        return None in self.slots and any(r.finish_reason is None for r in self.requests[self._pending :])

    def _decoding(self) -> bool:
        """Whether a request decodes (a member of a group, or waiting to join one)."""
        return any(g.members for g in self.groups.values()) or any(
            r.group is None and not r.cancelled and len(r.prompt) - r.fed <= 1 for r in self._running())

    def _next_micro_batch(self, request: RequestState) -> MicroBatch:
        """Feed ``request``'s next tokens as ``generate_step`` does, and say when it may enter again."""
        remaining = len(request.prompt) - request.fed
        start = (len(request.fed_tokens),)
        if remaining > 1:
            n = min(self.prefill_step, remaining - 1)
            if self.prefill_budget is not None and self._decoding():
                n = min(n, self.prefill_budget)
            tokens = tuple(request.prompt[request.fed : request.fed + n])
            request.fed += n
            request.ready_at = self.tick + 1
            request.fed_tokens.extend(tokens)
            return MicroBatch((request.index,), (tokens,), samples=False, starts=start)
        if remaining == 1:
            tokens = (request.prompt[-1],)
            request.fed += 1
        else:
            tokens = (request.generated[-1],)
        request.ready_at = _NEVER  # until its token is sampled
        request.fed_tokens.extend(tokens)
        return MicroBatch((request.index,), (tokens,), samples=True, starts=start)
