"""The engine of one rank: requests overlapped across the stages, joining and leaving at any tick.

With one request, a pipeline of N ranks has one rank busy at a time. Here
requests run in lockstep ticks (see ``schedule.Schedule``): at each tick every
stage runs one micro-batch, so all stages compute at once. A micro-batch is
one request's prefill chunk, or the decode step of a group of up to
``decode_batch`` requests, whose caches on every stage are one of mlx-lm's
batch caches (``BatchKVCache``, ``BatchRotatingKVCache``...: per-request
offsets, left padding and masks), merged from the requests' own caches as they
join and filtered as they leave, as mlx-lm's ``BatchGenerator`` does. One tick
on this rank, in an order every rank shares so that no socket carries two
messages out of turn:

1. run this stage's micro-batch (if any) through the model with its caches,
   and send the hidden state on to rank - 1 (rank 0 instead samples each
   row's token, with that request's own sampler, when the micro-batch asks);
2. receive from rank + 1 the hidden state of the next tick's micro-batch
   (``hop``: what crosses the cut, and how it is handed in and out);
3. one small collective: rank 0's tokens reach every rank (the first stage
   embeds it next, and every rank applies it to the same schedule, so all learn
   together that a request ended and its slot is free), and, when the loop
   serves a stream of requests, the ranks agree how many messages (new
   requests, cancellations) every one of them has received, so each applies
   the same ones at the same tick, whenever its own standard input delivered
   them.

A send can only block on its receiver's step 2, which never waits on the
sender's own later steps, so the ring cannot deadlock, even with prefill
chunks too large for the sockets' buffers. The stand-ins of the generic
pipeline (``stages.stage.Exchange``) keep every model's own masks and cache
bookkeeping; each request has its own caches on every rank, made with mlx-lm's
``make_prompt_cache`` or taken from the prompt cache's tiers (``caches.prompt_caches``:
mlx-lm's ``LRUPromptCache`` in memory, each rank's own folder on disk), the
longest cached prefix of its prompt, the same on every rank.

Each rank also times where its ticks go (``TimeSpent``): computing, sending,
waiting for its input, waiting in the collective, idle without requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import LRUPromptCache

from mlxpipe.errors import MlxpipeError, UsageError
from mlxpipe.model.facts import text_config_of
from mlxpipe.protocol.events import BatchDone
from mlxpipe.protocol.message import Message
from mlxpipe.protocol.messages import Cancel, Exit, RequestId, Submit
from mlxpipe.protocol.request import Request
from mlxpipe.worker.agree import read_tick, tick_collective
from mlxpipe.worker.caches.batch_caches import BatchCaches, decode_batch_for
from mlxpipe.worker.caches.disk_cache import DiskCache
from mlxpipe.worker.caches.prompt_caches import PromptCaches
from mlxpipe.worker.context import RankContext
from mlxpipe.worker.generation.ahead import Lookahead
from mlxpipe.worker.generation.hop import Hop
from mlxpipe.worker.generation.reporters import Reporter, Timing
from mlxpipe.worker.generation.sampling import Samplers, extra_eos_ids, logits_processors
from mlxpipe.worker.generation.schedule import FAILED, MicroBatch, Schedule
from mlxpipe.worker.generation.vision_inputs import VisionInputs
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.inbox import Inbox

_CLEAR_CACHE_TICKS = 256


@dataclass
class TimeSpent:
    """Where one rank's time goes, in seconds, over a ``run``."""

    compute: float = 0.0  # this stage's layers on its micro-batches (and sampling, on rank 0; the vision tower)
    vision: float = 0.0  # of compute: the vision tower and projector on prompts' images (the first stage)
    send: float = 0.0  # handing hidden states to rank - 1 (blocks while it cannot take them)
    recv: float = 0.0  # waiting for hidden states from rank + 1: the hop into this rank
    sync: float = 0.0  # the per-tick collective: waiting for rank 0's tokens (and the others)
    idle: float = 0.0  # serving with nothing to compute: waiting for requests

    def report(self, wall: float) -> dict[str, float]:
        """The figures, and ``busy``: the share of the time with work in the pipeline spent computing."""
        working = wall - self.idle
        return {**asdict(self), "wall": wall, "busy": self.compute / working if working > 0 else 0.0}


class Engine:
    """The overlapped requests of one rank; see the module docstring."""

    def __init__(
        self, context: RankContext, slots: int, reporter: Reporter, prompt_cache_size: int = 0,
        prompt_cache: LRUPromptCache | None = None, decode_batch: int = 1, disk_cache: DiskCache | None = None,
        disk_tier: bool = False, prefill_budget: int | None = None,
    ) -> None:
        """``prompt_cache``: a memory tier the caller keeps (chat turns), else one of ``prompt_cache_size``
        entries; ``disk_cache``, ``disk_tier``: the disk tier (``caches.prompt_caches.PromptCaches``);
        ``prefill_budget``: a prefill chunk's tokens while another request decodes (``schedule``)."""
        loaded, group = context.loaded, context.group
        self.context, self.reporter = context, reporter
        self.model = loaded.model
        self.rank, self.size = group.rank(), group.size()  # in the world: rank 0 samples
        # The pipeline's stages (a tensor-parallel group each, with --tp): stage 0 runs the last layers.
        self.topology = loaded.topology or Topology(group, 1)
        self.pipe_rank, self.pipe_size = self.topology.stage, self.topology.stages
        self.stage = self.pipe_size - 1 - self.pipe_rank  # the schedule's stage: the first is the highest
        # What this stage receives and sends on, moved by the engine itself (``hop``).
        self.hop = Hop(self.model, self.topology, self.stage == 0, loaded.positions)
        if self.pipe_size > 1 and self.hop.exchange is None:
            raise UsageError(
                "overlapped requests need the generic pipeline", hint="run without --pipeline native"
            )
        self.decode_batch = decode_batch_for(self.model, context.job, decode_batch)
        self.schedule = Schedule(
            [], [], stages=self.pipe_size, slots=slots, prefill_step=context.job.prefill_step_size,
            eos_ids=loaded.tokenizer.eos_token_ids, decode_batch=self.decode_batch, prefill_budget=prefill_budget,
        )
        self.requests: list[Request] = []
        self.caches = BatchCaches(self.schedule, self.decode_batch)
        self.spent = TimeSpent()
        # Serving: called on every rank with its time figures whenever a request ends.
        self.on_time: Callable[[dict[str, float]], None] | None = None
        self._tic = time.perf_counter()
        self.sampling = Samplers(loaded.tokenizer)  # rank 0's (the other ranks sample nothing)
        self.eos: dict[int, set[int]] = {}  # each request's end-of-sequence ids, its extra ones included
        self.timing: dict[int, Timing] = {}
        # Why a request ended with "error" (rank 0 knows what its sampling raised; every rank, a refusal).
        self.errors: dict[int, str] = {}
        self.vocab_size = text_config_of(loaded.config).get("vocab_size")
        if prompt_cache is None and prompt_cache_size > 0:
            prompt_cache = LRUPromptCache(max_size=prompt_cache_size)
        self.prompt_caches = PromptCaches(self.model, context.job, group, prompt_cache, disk_cache, disk_tier)
        self.cache_tiers: dict[int, str] = {}  # where a request's cached tokens came from: "memory" or "disk"
        self._by_id: dict[RequestId, int] = {}
        self._exit = False
        # A vision-language model: the first stage keeps each prompt's input embeddings and position ids
        # (``vision_inputs``); with position ids, those of each micro-batch travel with its hidden state.
        self.vision = (VisionInputs(self.model, loaded.processor, loaded.config, self.stage == 0, loaded.positions)
                       if loaded.vision else None)
        self.positions = loaded.positions
        # One stage (pure tensor parallelism): requests whose token can stay lazy, and the decode step
        # scheduled one tick ahead (``ahead``).
        self.lookahead = Lookahead(self.model, self.schedule, self.pipe_size == 1 and not self.positions,
                                   self.topology.samples, self.sampling, self._shared)

    # --- requests in ---------------------------------------------------------------

    def add(self, request: Request, prompt: list[int]) -> int:
        """Queue ``request`` (its prompt as tokens); it starts when a slot frees. A request this rank cannot run
        (its options out of range here) ends at once with an error: every rank refuses it alike."""
        tokenizer = self.context.loaded.tokenizer
        try:
            if not prompt:
                raise UsageError("the prompt has no tokens")
            if request.images and self.vision is None:
                raise UsageError("this model takes no images")
            request = request.check(vocab_size=self.vocab_size)
            if request.resumed >= len(prompt):
                raise UsageError(f"'resumed' ({request.resumed}) must be below the prompt's {len(prompt)} tokens")
            extra = extra_eos_ids(tokenizer, request.extra_eos_token)
        except MlxpipeError as e:
            return self.refuse(request, e.message)
        found = self.prompt_caches.fetch(prompt, request, self._cache_key(request, prompt))
        cache, cached = found.cache, found.tokens
        # Decode groups merge their members' caches: quantized ones cannot merge (mlx-lm's
        # is_batchable), and caches of one kind only, so requests group by their cache settings.
        key = None if request.kv_bits is not None else (request.max_kv_size or self.context.job.max_kv_size,)
        index = self.schedule.add(prompt, request.max_tokens, cached, extra_eos=extra, batch_key=key)
        self.requests.append(request)
        if self.vision is not None and self.stage == 0:  # the first stage: the vision tower, once per prompt
            tic = time.perf_counter()
            self.vision.add(index, request, prompt)
            spent = time.perf_counter() - tic
            self.spent.vision += spent
            self.spent.compute += spent
        self.caches.own[index] = cache
        if found.tier is not None:
            self.cache_tiers[index] = found.tier
        self.eos[index] = set(tokenizer.eos_token_ids) | extra
        if request.id is not None:
            self._by_id[request.id] = index
        return index

    def refuse(self, request: Request, message: str) -> int:
        """Add ``request`` as ended with an error (its prompt could not be made, say): reported, never run."""
        index = self.schedule.add_failed()
        self.requests.append(request)
        self.errors[index] = message
        self.eos[index] = set()
        if request.id is not None:
            self._by_id[request.id] = index
        self._finish(index)
        return index

    def apply(self, message: Message | None) -> None:
        """A message every rank applies at the same tick: submit, cancel or exit (None: end of input)."""
        if isinstance(message, Submit):
            self.add(message.request, [int(t) for t in message.request.tokens or ()])
        elif isinstance(message, Cancel):
            index = self._by_id.get(message.id)
            if index is not None and self.schedule.cancel(index):
                self._finish(index)
        elif message is None or isinstance(message, Exit):
            self._exit = True
        else:
            raise UsageError(f"a {message.TAG!r} message while serving: only submit, cancel and exit")

    # --- the loop ------------------------------------------------------------------

    def run(self, inbox: Inbox | None = None) -> BatchDone:
        """Run until every request has ended (no ``inbox``), or until an agreed ``exit`` (with one)."""
        with self.hop.explicit():
            return self._run(inbox)

    def _run(self, inbox: Inbox | None) -> BatchDone:
        # Requests added before the run (generate, a batch) ran their images through the vision tower already:
        # that time is the run's too, so that busy stays the share of the run's time spent computing.
        tic = self._tic = time.perf_counter() - self.spent.vision
        self.hop.probe()
        hidden_in = None
        progress = self.context.progress
        progress.reset()
        while not self._exit and (inbox is not None or not self.schedule.done):
            if inbox is not None and self.schedule.idle:
                waited = time.perf_counter()
                inbox.wait_beyond(inbox.consumed)  # nothing to compute: wait for a message
                self.spent.idle += time.perf_counter() - waited
            hidden_in = self._tick(hidden_in, inbox)
            progress.tick(self.schedule.tick, self._doing())
        for state in self.schedule.requests:
            if state.finish_reason is None:
                self.schedule.cancel(state.index)  # at exit: whatever still runs ends here
                self._finish(state.index)
        mx.synchronize()
        seconds = time.perf_counter() - tic
        return BatchDone(
            rank=self.rank,
            requests=len(self.requests),
            concurrency=len(self.schedule.slots),
            ticks=self.schedule.tick + 1,
            generation_tokens=sum(len(r.generated) for r in self.schedule.requests),
            seconds=seconds,
            peak_memory=mx.get_peak_memory() / 1e9,
            decode_batch=self.decode_batch,
            run_ahead=dict(self.lookahead.counts),
            time=self.spent.report(seconds),
        )

    def _tick(self, hidden_in: mx.array | None, inbox: Inbox | None) -> mx.array | None:
        """Steps 1 to 3 of the module docstring; returns the hidden state the next tick starts from."""
        for index in self.schedule.begin_tick():
            self._admit(index)
        for index in self.schedule.ended:
            self._finish(index)
        for group in self.schedule.ended_groups:
            self.caches.groups.pop(group, None)
        batch = self.schedule.at(self.stage)
        self.lookahead.check(batch)
        sampling = self.schedule.sampling
        tokens: list[int] | None
        if batch is not None and self.lookahead.runs_lazily(batch):  # steps 1 and 3, the token read lazily
            tic = time.perf_counter()
            tokens, agreed = self.lookahead.run(batch, self.caches.for_batch(batch), inbox)
            self.spent.compute += time.perf_counter() - tic
            hidden_next = None
        else:
            sampled = self._run_stage(batch, hidden_in) if batch is not None else None
            hidden_next = self._receive(self.schedule.next_at(self.stage)) if self.stage > 0 else None
            tokens, agreed = self._share(sampled, sampling, inbox)
        if sampling is not None and tokens is not None:
            for index, token in zip(sampling.requests, tokens, strict=False):  # end_tick checks the count
                if not self.schedule.requests[index].cancelled and token != FAILED:
                    self._on_token(index, token)
        for index in self.schedule.end_tick(tokens):
            self._finish(index)
        if inbox is not None:
            for message in inbox.take(agreed):
                self.apply(message)
        if self.schedule.tick % _CLEAR_CACHE_TICKS == 0:
            mx.clear_cache()
        return hidden_next

    def _doing(self) -> str:
        """What this stage ran at the last tick, for the stall watchdog's report."""
        batch = self.schedule.at(self.stage)
        if batch is None:
            running = sum(r.running for r in self.schedule.requests)
            return f"no micro-batch ({running} requests running)"
        if batch.group is not None and len(batch.requests) > 1:
            return f"decode a token of each of requests {', '.join(map(str, batch.requests))}"
        request = self.schedule.requests[batch.request]
        if batch.samples:
            return f"decode token {len(request.generated) + 1} of request {batch.request}"
        return f"prefill {len(batch.tokens)} of {len(request.prompt)} tokens of request {batch.request}"

    def _on_token(self, index: int, token: int) -> None:
        timing = self.timing[index]
        if timing.first_token is None:
            timing.first_token = time.perf_counter()
        if self.rank == 0:
            self.reporter.token(self, index, token)

    # --- one tick ------------------------------------------------------------------

    def _admit(self, index: int) -> None:
        request = self.requests[index]
        self.timing[index] = Timing(admitted=time.perf_counter())
        processors = logits_processors(request)
        if self.rank == 0:
            self.sampling.admit(index, request, self.eos[index], processors)
        self.lookahead.admit(index, request, bool(processors))

    def _run_stage(self, batch: MicroBatch, hidden_in: mx.array | None) -> mx.array | None:
        """Step 1: this stage's layers on ``batch``; send on, or sample on rank 0."""
        tic = time.perf_counter()
        cache = self.caches.for_batch(batch)
        self.hop.enter(hidden_in)
        inputs = mx.array(batch.rows)
        extra = self.vision.inputs(batch, inputs, self.hop.positions_in) if self.vision is not None else {}
        logits = self.model(inputs, cache=cache, **extra)
        if len(batch.requests) == 1:
            # As generate_step: after every forward pass (the stand-ins' caches take it too). A request
            # with quantized caches decodes alone (its batch_key), so a group never needs it.
            maybe_quantize_kv_cache(cache, **self.requests[batch.request].kv_kwargs())
        state = [c.state for c in cache]
        if self.pipe_rank > 0:
            hidden_out = self.hop.outgoing(extra)
            mx.eval(hidden_out, state)
            sending = time.perf_counter()
            self.spent.compute += sending - tic
            self.hop.send(hidden_out)
            self.spent.send += time.perf_counter() - sending
            return None
        if not batch.samples:
            mx.eval(state)  # a prefill chunk: only the caches matter, as in generate_step
            self.spent.compute += time.perf_counter() - tic
            return None
        logits = logits[:, -1, :]
        if not self.topology.samples:
            # Another member of the first stage's tensor group: its share of the logits (the gather
            # of the sliced vocabulary head) is needed; rank 0 samples.
            mx.eval(logits, state)
            self.spent.compute += time.perf_counter() - tic
            return None
        sampled = mx.array([self._sample(index, logits[row : row + 1]) for row, index in enumerate(batch.requests)],
                           mx.int32)
        mx.eval(sampled, state)
        self.spent.compute += time.perf_counter() - tic
        return sampled

    def _sample(self, index: int, logits: mx.array) -> int:
        """Rank 0: one request's token from its row of logits (``sampling.Samplers``). Whatever its sampling raises
        ends this request alone (``FAILED``, shared with every rank at this tick)."""
        try:
            return self.sampling.sample(index, self.requests[index], self.schedule.requests[index], logits)
        except Exception as e:  # noqa: BLE001 - one request's options or sampler: that request fails, not the rank
            self.errors[index] = f"sampling failed on rank 0: {type(e).__name__}: {e}"
            return FAILED

    def _receive(self, batch: MicroBatch | None) -> mx.array | None:
        """Step 2: the hidden state of the next tick's micro-batch, from stage + 1."""
        if batch is None:
            return None
        tic = time.perf_counter()
        hidden = self.hop.receive(len(batch.requests), batch.width)
        self.spent.recv += time.perf_counter() - tic
        return hidden

    def _share(
        self, sampled: mx.array | None, sampling: MicroBatch | None, inbox: Inbox | None
    ) -> tuple[list[int] | None, int]:
        """Step 3: rank 0's tokens on every rank and, with an inbox, the messages every rank has."""
        tic = time.perf_counter()
        try:
            return self._share_now(sampled, sampling, inbox)
        finally:
            self.spent.sync += time.perf_counter() - tic

    def _share_now(
        self, sampled: mx.array | None, sampling: MicroBatch | None, inbox: Inbox | None
    ) -> tuple[list[int] | None, int]:
        received = inbox.received if inbox is not None else 0
        if self.size == 1:
            if sampling is None or sampled is None:
                return None, received
            return cast(list[int], sampled.tolist()), received
        if inbox is None and sampling is None:
            return None, 0
        rows = len(sampling.requests) if sampling is not None else 1
        tokens, agreed = read_tick(self._shared(sampled, rows, inbox), rows, inbox is not None)
        return (tokens if sampling is not None else None), agreed

    def _shared(self, sampled: mx.array | None, rows: int, inbox: Inbox | None) -> mx.array:
        """The tick's collective, lazy (``agree.tick_collective``)."""
        received = inbox.received if inbox is not None else None
        return tick_collective(self.context.group, sampled if self.rank == 0 else None, rows, received)

    def _finish(self, index: int) -> None:
        """Drop a request's caches (keeping them in the prompt cache's tiers) and report it."""
        self.lookahead.forget(index)
        cache = self.caches.own.pop(index, None)
        if cache is None and self.prompt_caches.keeps and self.caches.group_of(index) is not None:
            cache = self.caches.take_own(index)
        self.sampling.drop(index)
        timing = self.timing.pop(index, None) or Timing(admitted=time.perf_counter())
        state = self.schedule.requests[index]
        if cache is not None and self.prompt_caches.keeps and state.fed_tokens:
            # Every micro-batch it entered has left every stage: the caches hold exactly fed_tokens.
            request = self.requests[index]
            self.prompt_caches.keep(state.fed_tokens, cache, request, self._cache_key(request, state.fed_tokens))
        if self.rank == 0:
            self.reporter.finished(self, index, timing, time.perf_counter())
        self.cache_tiers.pop(index, None)
        self.eos.pop(index, None)
        if self.vision is not None:
            self.vision.drop(index)
        self.errors.pop(index, None)
        if self.on_time is not None:
            self.on_time(self.spent.report(time.perf_counter() - self._tic))

    def _cache_key(self, request: Request, tokens: Sequence[int]) -> list[int]:
        """The prompt cache's key of ``tokens`` (a vision model's: each image's own, ``VisionInputs.cache_key``)."""
        return self.vision.cache_key(request, tokens) if self.vision is not None else list(tokens)
