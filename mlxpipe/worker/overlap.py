"""Overlapped requests on one rank: every stage busy with a different request.

With one request, a pipeline of N ranks has one rank busy at a time. Here a
batch of requests runs in lockstep ticks (see ``schedule.Schedule``): at each
tick every stage runs one micro-batch of a different request, so all stages
compute at once. One tick on this rank, in an order every rank shares so that
no socket carries two messages out of turn:

1. run this stage's micro-batch (if any) through the model with the request's
   own caches, and send the hidden state on to rank - 1 (rank 0 instead
   samples the token when the micro-batch asks for one);
2. receive from rank + 1 the hidden state of the next tick's micro-batch;
3. when the last stage sampled, share the token with every rank (a one-element
   ``all_sum``): the first stage embeds it next, and every rank applies it to
   the same schedule, so all learn together that a request ended and its slot
   is free.

A send can only block on its receiver's step 2, which never waits on the
sender's own later steps, so the ring cannot deadlock, even with prefill
chunks too large for the sockets' buffers. The stand-ins of the generic
pipeline (``pipeline.Exchange``) keep every model's own masks and cache
bookkeeping; each request has its own caches on every rank, made with mlx-lm's
``make_prompt_cache``, and dropped when it ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_p

from mlxpipe.errors import UsageError
from mlxpipe.worker.pipeline import Exchange, find_exchange
from mlxpipe.worker.schedule import MicroBatch, Schedule

if TYPE_CHECKING:
    from mlxpipe.worker.serve import Server

DEFAULT_MAX_TOKENS = 256
_CLEAR_CACHE_TICKS = 256

Sampler = Callable[[mx.array], mx.array]


def make_keyed_sampler(temp: float, top_p: float, min_p: float, seed: int | None) -> Sampler:
    """mlx-lm's ``make_sampler`` with the request's own random key.

    Requests sample in turns, so they cannot share the global key; each draws
    from ``mx.random.key(seed)`` split as the global key would be, so a request
    samples the same tokens as when it runs alone with ``mx.random.seed(seed)``.
    """
    if temp == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    key = mx.random.key(0 if seed is None else int(seed))

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p, 1)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


@dataclass
class _Timing:
    """Rank 0's clock for one request."""

    admitted: float
    first_token: float | None = None


@dataclass
class BatchRun:
    """One batch of overlapped requests on this rank."""

    server: "Server"
    requests: list[dict[str, Any]]
    concurrency: int
    emit: Callable[..., None]
    schedule: Schedule = field(init=False)

    def __post_init__(self) -> None:
        loaded, group = self.server.loaded, self.server.group
        self.model = loaded.model
        self.rank, self.size = group.rank(), group.size()
        self.stage = self.size - 1 - self.rank  # the first stage is the highest rank
        self.exchange: Exchange | None = find_exchange(self.model)
        if self.size > 1 and self.exchange is None:
            raise UsageError(
                "overlapped requests need the generic pipeline",
                hint="run the batch without --pipeline native",
            )
        prompts = [self.server.prompt_tokens(r) for r in self.requests]
        for request, prompt in zip(self.requests, prompts):
            if not prompt:
                raise UsageError(f"request {request.get('id', '?')}: the prompt has no tokens")
        max_tokens = [int(r.get("max_tokens", DEFAULT_MAX_TOKENS)) for r in self.requests]
        if any(m < 1 for m in max_tokens):
            raise UsageError("max_tokens must be at least 1 for every request")
        self.schedule = Schedule(
            prompts,
            max_tokens,
            stages=self.size,
            slots=self.concurrency,
            prefill_step=self.server.job.prefill_step_size,
            eos_ids=self.server.loaded.tokenizer.eos_token_ids,
        )
        self.caches: dict[int, list[Any]] = {}
        self.samplers: dict[int, Sampler] = {}
        self.timing: dict[int, _Timing] = {}

    def run(self) -> dict[str, Any]:
        """Run every request to its end; rank 0 emits a ``result`` for each as it finishes."""
        if self.exchange is not None:
            self.exchange.explicit = True
        try:
            return self._run()
        finally:
            if self.exchange is not None:
                self.exchange.explicit = False
                self.exchange.hidden_in = self.exchange.hidden_out = None

    def _run(self) -> dict[str, Any]:
        tic = time.perf_counter()
        self._probe_incoming()
        hidden_in = None
        progress = self.server.progress
        progress.reset()
        while not self.schedule.done:
            hidden_in = self._tick(hidden_in)
            progress.tick(self.schedule.tick, sum(r.running for r in self.schedule.requests))
        mx.synchronize()
        return {
            "rank": self.rank,
            "requests": len(self.requests),
            "concurrency": self.concurrency,
            "ticks": self.schedule.tick + 1,
            "generation_tokens": self._generated(),
            "seconds": time.perf_counter() - tic,
            "peak_memory": mx.get_peak_memory() / 1e9,
        }

    def _tick(self, hidden_in: mx.array | None) -> mx.array | None:
        """Steps 1 to 3 of the module docstring; returns the hidden state the next tick starts from."""
        for index in self.schedule.begin_tick():
            self._admit(index)
        batch = self.schedule.at(self.stage)
        sampled = self._run_stage(batch, hidden_in) if batch is not None else None
        hidden_next = self._receive(self.schedule.next_at(self.stage)) if self.stage > 0 else None
        sampling = self.schedule.sampling
        token = self._share(sampled) if sampling is not None else None
        finished = self.schedule.end_tick(token)
        if sampling is not None and self.timing[sampling.request].first_token is None:
            self.timing[sampling.request].first_token = time.perf_counter()
        if finished is not None:
            self._finish(finished)
        if self.schedule.tick % _CLEAR_CACHE_TICKS == 0:
            mx.clear_cache()
        return hidden_next

    def _generated(self) -> int:
        return sum(len(r.generated) for r in self.schedule.requests)

    # --- one tick ------------------------------------------------------------------

    def _admit(self, index: int) -> None:
        request = self.requests[index]
        self.caches[index] = make_prompt_cache(self.model, max_kv_size=self.server.job.max_kv_size)
        self.timing[index] = _Timing(admitted=time.perf_counter())
        if self.rank == 0:
            self.samplers[index] = make_keyed_sampler(
                float(request.get("temp", 0.0)),
                float(request.get("top_p", 0.0)),
                float(request.get("min_p", 0.0)),
                request.get("seed"),
            )

    def _run_stage(self, batch: MicroBatch, hidden_in: mx.array | None) -> mx.array | None:
        """Step 1: this stage's layers on ``batch``; send on, or sample on rank 0."""
        cache = self.caches[batch.request]
        if self.exchange is not None:
            self.exchange.hidden_in, self.exchange.hidden_out = hidden_in, None
        logits = self.model(mx.array(batch.tokens)[None], cache=cache)
        state = [c.state for c in cache]
        if self.rank > 0:
            assert self.exchange is not None and self.exchange.hidden_out is not None
            sent = mx.distributed.send(self.exchange.hidden_out, self.rank - 1, group=self.server.group)
            mx.eval(sent, state)
            return None
        if not batch.samples:
            mx.eval(state)  # a prefill chunk: only the caches matter, as in generate_step
            return None
        logits = logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = self.samplers[batch.request](logprobs)
        mx.eval(token, state)
        return token

    def _receive(self, batch: MicroBatch | None) -> mx.array | None:
        """Step 2: the hidden state of the next tick's micro-batch, from rank + 1."""
        if batch is None:
            return None
        shape, dtype = self._incoming_shape(len(batch.tokens))
        hidden = mx.distributed.recv(shape, dtype, self.rank + 1, group=self.server.group)
        mx.eval(hidden)
        return hidden

    def _share(self, sampled: mx.array | None) -> int:
        """Step 3: rank 0's token, on every rank."""
        if self.size == 1:
            assert sampled is not None
            return int(sampled.item())
        if self.rank == 0:
            assert sampled is not None
            mine = sampled.reshape(1).astype(mx.int32)
        else:
            mine = mx.zeros((1,), mx.int32)
        return int(mx.distributed.all_sum(mine, group=self.server.group, stream=mx.cpu).item())

    def _finish(self, index: int) -> None:
        self.caches.pop(index, None)
        self.samplers.pop(index, None)
        timing = self.timing.pop(index)
        if self.rank == 0:
            self._emit_result(index, timing, time.perf_counter())

    # --- shapes and results --------------------------------------------------------

    def _probe_incoming(self) -> None:
        """Learn the shape and dtype of the hidden state this rank receives.

        One lazy call on throwaway caches, never evaluated: the first local
        layer notes what arrives there (the stand-ins pass the embedding on).
        """
        if self.exchange is None or self.stage == 0:
            return
        self.exchange.hidden_in = None
        self.model(mx.array([[0]]), cache=make_prompt_cache(self.model))
        if self.exchange.incoming is None:
            raise RuntimeError("the pipeline's first local layer was never called")

    def _incoming_shape(self, num_tokens: int) -> tuple[tuple[int, ...], Any]:
        assert self.exchange is not None and self.exchange.incoming is not None
        shape, dtype = self.exchange.incoming
        return (1, num_tokens, *shape[2:]), dtype

    def _emit_result(self, index: int, timing: _Timing, now: float) -> None:
        state = self.schedule.requests[index]
        request = self.requests[index]
        tokens = state.generated
        first = timing.first_token or now
        after_first = now - first
        self.emit(
            "result",
            rank=self.rank,
            index=index,
            id=request.get("id", index),
            tokens=tokens,
            text=self._text(tokens),
            prompt_tokens=len(state.prompt),
            generation_tokens=len(tokens),
            finish_reason=state.finish_reason,
            ttft=first - timing.admitted,
            latency=now - timing.admitted,
            # As mlx-lm's stream_generate: every token over the time after the first.
            generation_tps=len(tokens) / after_first if after_first > 0 else 0.0,
            slot=state.slot,
            ticks=[state.admitted_tick, state.finished_tick],
        )

    def _text(self, tokens: list[int]) -> str:
        """The text ``stream_generate`` would have streamed: the end-of-sequence token is not shown."""
        tokenizer = self.server.loaded.tokenizer
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for token in tokens:
            if token not in tokenizer.eos_token_ids:
                detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text
