"""The request loop of one rank: requests overlapped across the stages, joining and leaving at any tick.

With one request, a pipeline of N ranks has one rank busy at a time. Here
requests run in lockstep ticks (see ``schedule.Schedule``): at each tick every
stage runs one micro-batch of a different request, so all stages compute at
once. One tick on this rank, in an order every rank shares so that no socket
carries two messages out of turn:

1. run this stage's micro-batch (if any) through the model with the request's
   own caches, and send the hidden state on to rank - 1 (rank 0 instead
   samples the token when the micro-batch asks for one);
2. receive from rank + 1 the hidden state of the next tick's micro-batch;
3. one small collective: rank 0's token reaches every rank (the first stage
   embeds it next, and every rank applies it to the same schedule, so all learn
   together that a request ended and its slot is free), and, when the loop
   serves a stream of requests, the ranks agree how many messages (new
   requests, cancellations) every one of them has received, so each applies
   the same ones at the same tick, whenever its own standard input delivered
   them.

A send can only block on its receiver's step 2, which never waits on the
sender's own later steps, so the ring cannot deadlock, even with prefill
chunks too large for the sockets' buffers. The stand-ins of the generic
pipeline (``pipeline.Exchange``) keep every model's own masks and cache
bookkeeping; each request has its own caches on every rank, made with mlx-lm's
``make_prompt_cache`` or taken from mlx-lm's ``LRUPromptCache`` (the longest
cached prefix of its prompt: every rank makes the same choice, since every rank
inserts and looks up the same token sequences in the same order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxpipe.errors import UsageError
from mlxpipe.request import Request
from mlxpipe.worker.inbox import Inbox
from mlxpipe.worker.pipeline import Exchange, find_exchange
from mlxpipe.worker.sampling import LogitsProcessor, Sampler, extra_eos_ids, keyed_sampler, logits_processors
from mlxpipe.worker.schedule import MicroBatch, Schedule

if TYPE_CHECKING:
    from mlxpipe.worker.serve import Server

_CLEAR_CACHE_TICKS = 256
_MODEL_KEY = "model"  # one model per rank: LRUPromptCache's key

@dataclass
class Timing:
    """Rank 0's clock for one request."""

    admitted: float
    first_token: float | None = None


class Reporter(Protocol):
    """What rank 0 tells the controller about requests (the other ranks report nothing)."""

    def token(self, engine: "Engine", index: int, token: int) -> None: ...

    def finished(self, engine: "Engine", index: int, timing: Timing, now: float) -> None: ...


class Engine:
    """The overlapped requests of one rank; see the module docstring."""

    def __init__(
        self, server: "Server", slots: int, reporter: Reporter, prompt_cache_size: int = 0,
        prompt_cache: LRUPromptCache | None = None,
    ) -> None:
        loaded, group = server.loaded, server.group
        self.server, self.reporter = server, reporter
        self.model = loaded.model
        self.rank, self.size = group.rank(), group.size()
        self.stage = self.size - 1 - self.rank  # the first stage is the highest rank
        self.exchange: Exchange | None = find_exchange(self.model)
        if self.size > 1 and self.exchange is None:
            raise UsageError(
                "overlapped requests need the generic pipeline", hint="run without --pipeline native"
            )
        self.schedule = Schedule(
            [], [], stages=self.size, slots=slots, prefill_step=server.job.prefill_step_size,
            eos_ids=loaded.tokenizer.eos_token_ids,
        )
        self.requests: list[Request] = []
        self.caches: dict[int, list[Any]] = {}
        self.samplers: dict[int, Sampler] = {}
        self.processors: dict[int, list[LogitsProcessor]] = {}
        self.eos: dict[int, set[int]] = {}  # each request's end-of-sequence ids, its extra ones included
        self.timing: dict[int, Timing] = {}
        if prompt_cache is None and prompt_cache_size > 0:
            prompt_cache = LRUPromptCache(max_size=prompt_cache_size)
        self.prompt_cache = prompt_cache  # kept by the caller when it outlives the engine (chat turns)
        self._by_id: dict[Any, int] = {}
        self._exit = False

    # --- requests in ---------------------------------------------------------------

    def add(self, request: Request, prompt: list[int]) -> int:
        """Queue ``request`` (its prompt as tokens); it starts when a slot frees."""
        if not prompt:
            raise UsageError(f"request {request.id if request.id is not None else '?'}: the prompt has no tokens")
        request.check()
        tokenizer = self.server.loaded.tokenizer
        extra = extra_eos_ids(tokenizer, request.extra_eos_token)
        cache, cached = self._cached(prompt, request)
        index = self.schedule.add(prompt, request.max_tokens, cached, extra_eos=extra)
        self.requests.append(request)
        self.caches[index] = cache
        self.eos[index] = set(tokenizer.eos_token_ids) | extra
        if request.id is not None:
            self._by_id[request.id] = index
        return index

    def _cached(self, prompt: list[int], request: Request) -> tuple[list[Any], int]:
        """Caches for ``prompt`` and how many of its tokens they hold (the longest cached prefix)."""
        if self.prompt_cache is not None:
            cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, prompt)
            if cache is not None and not rest:
                # The whole prompt is cached; one token must still be fed for the logits.
                rest = prompt[-1:] if can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 1 else prompt
            if cache is not None and len(rest) < len(prompt):
                return cache, len(prompt) - len(rest)
        return make_prompt_cache(self.model, max_kv_size=request.max_kv_size or self.server.job.max_kv_size), 0

    def apply(self, message: dict[str, Any] | None) -> None:
        """A message every rank applies at the same tick: submit, cancel or exit (None: end of input)."""
        kind = "exit" if message is None else message.get("type")
        if kind == "submit":
            request = Request.from_wire(message)
            self.add(request, [int(t) for t in request.tokens or ()])
        elif kind == "cancel":
            index = self._by_id.get(message.get("id"))
            if index is not None and self.schedule.cancel(index):
                self._finish(index)
        elif kind == "exit":
            self._exit = True
        else:
            raise UsageError(f"unknown message {kind!r} while serving")

    # --- the loop ------------------------------------------------------------------

    def run(self, inbox: Inbox | None = None) -> dict[str, Any]:
        """Run until every request has ended (no ``inbox``), or until an agreed ``exit`` (with one)."""
        if self.exchange is not None:
            self.exchange.explicit = True
        try:
            return self._run(inbox)
        finally:
            if self.exchange is not None:
                self.exchange.explicit = False
                self.exchange.hidden_in = self.exchange.hidden_out = None

    def _run(self, inbox: Inbox | None) -> dict[str, Any]:
        tic = time.perf_counter()
        self._probe_incoming()
        hidden_in = None
        progress = self.server.progress
        progress.reset()
        while not self._exit and (inbox is not None or not self.schedule.done):
            if inbox is not None and self.schedule.idle:
                inbox.wait_beyond(inbox.consumed)  # nothing to compute: wait for a message
            hidden_in = self._tick(hidden_in, inbox)
            progress.tick(self.schedule.tick, self._doing())
        for index in list(self.caches):
            self.schedule.cancel(index)  # at exit: whatever still runs ends here
            self._finish(index)
        mx.synchronize()
        return {
            "rank": self.rank,
            "requests": len(self.requests),
            "concurrency": len(self.schedule.slots),
            "ticks": self.schedule.tick + 1,
            "generation_tokens": sum(len(r.generated) for r in self.schedule.requests),
            "seconds": time.perf_counter() - tic,
            "peak_memory": mx.get_peak_memory() / 1e9,
        }

    def _tick(self, hidden_in: mx.array | None, inbox: Inbox | None) -> mx.array | None:
        """Steps 1 to 3 of the module docstring; returns the hidden state the next tick starts from."""
        for index in self.schedule.begin_tick():
            self._admit(index)
        for index in self.schedule.ended:
            self._finish(index)
        batch = self.schedule.at(self.stage)
        sampled = self._run_stage(batch, hidden_in) if batch is not None else None
        hidden_next = self._receive(self.schedule.next_at(self.stage)) if self.stage > 0 else None
        sampling = self.schedule.sampling
        token, agreed = self._share(sampled, sampling is not None, inbox)
        if sampling is not None and token is not None:
            if not self.schedule.requests[sampling.request].cancelled:
                self._on_token(sampling.request, token)
        finished = self.schedule.end_tick(token)
        if finished is not None:
            self._finish(finished)
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
        if self.rank == 0:
            self.samplers[index] = keyed_sampler(request, self.server.loaded.tokenizer, self.eos[index])
            self.processors[index] = logits_processors(request)

    def _run_stage(self, batch: MicroBatch, hidden_in: mx.array | None) -> mx.array | None:
        """Step 1: this stage's layers on ``batch``; send on, or sample on rank 0."""
        cache = self.caches[batch.request]
        if self.exchange is not None:
            self.exchange.hidden_in, self.exchange.hidden_out = hidden_in, None
        logits = self.model(mx.array(batch.tokens)[None], cache=cache)
        # As generate_step: after every forward pass (the stand-ins' caches take it too).
        maybe_quantize_kv_cache(cache, **self.requests[batch.request].kv_kwargs())
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
        processors = self.processors[batch.request]
        if processors:
            # As generate_step: the processors see every token fed so far, prompt and reply.
            request = self.schedule.requests[batch.request]
            history = mx.array([*request.prompt, *request.generated], dtype=mx.uint32)
            for processor in processors:
                logits = processor(history, logits)
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

    def _share(self, sampled: mx.array | None, sampling: bool, inbox: Inbox | None) -> tuple[int | None, int]:
        """Step 3: rank 0's token on every rank and, with an inbox, the messages every rank has."""
        received = inbox.received if inbox is not None else 0
        if self.size == 1:
            return (int(sampled.item()) if sampling and sampled is not None else None), received
        if inbox is None:
            if not sampling:
                return None, 0
            mine = sampled.reshape(1).astype(mx.int32) if self.rank == 0 else mx.zeros((1,), mx.int32)
            return int(mx.distributed.all_sum(mine, group=self.server.group, stream=mx.cpu).item()), 0
        token = sampled.reshape(1).astype(mx.int32) if self.rank == 0 and sampled is not None else mx.array([-1])
        mine = mx.concatenate([token.astype(mx.int32), mx.array([received], mx.int32)])
        every = mx.distributed.all_gather(mine, group=self.server.group, stream=mx.cpu).reshape(self.size, 2)
        values = every.tolist()
        return (int(values[0][0]) if sampling else None), min(int(v[1]) for v in values)

    def _finish(self, index: int) -> None:
        """Drop a request's caches (keeping them in the prompt cache) and report it."""
        cache = self.caches.pop(index, None)
        self.samplers.pop(index, None)
        self.processors.pop(index, None)
        timing = self.timing.pop(index, None) or Timing(admitted=time.perf_counter())
        state = self.schedule.requests[index]
        if cache is not None and self.prompt_cache is not None and state.fed_tokens:
            # Every micro-batch it entered has left every stage: the caches hold exactly fed_tokens.
            self.prompt_cache.insert_cache(_MODEL_KEY, list(state.fed_tokens), cache)
        if self.rank == 0:
            self.reporter.finished(self, index, timing, time.perf_counter())
        self.eos.pop(index, None)

    # --- shapes --------------------------------------------------------------------

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
        assert self.exchange is not None
        return self.exchange.incoming_shape(num_tokens)


def text_of(tokenizer: Any, tokens: list[int], eos_ids: set[int] | None = None) -> str:
    """The text ``stream_generate`` would have streamed: the end-of-sequence token is not shown."""
    eos_ids = tokenizer.eos_token_ids if eos_ids is None else eos_ids
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        if token not in eos_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@dataclass
class BatchReporter:
    """``generate --prompts-file``: one ``result`` event per request, with its text and figures."""

    emit: Callable[..., None]

    def token(self, engine: Engine, index: int, token: int) -> None:
        pass

    def finished(self, engine: Engine, index: int, timing: Timing, now: float) -> None:
        state = engine.schedule.requests[index]
        request = engine.requests[index]
        tokens = state.generated
        first = timing.first_token or now
        after_first = now - first
        self.emit(
            "result",
            rank=engine.rank,
            index=index,
            id=request.id if request.id is not None else index,
            tokens=tokens,
            text=text_of(engine.server.loaded.tokenizer, tokens, engine.eos.get(index)),
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


@dataclass
class StreamReporter:
    """``serve``: every token as it is sampled, then ``finished`` (the controller makes the text)."""

    emit: Callable[..., None]

    def token(self, engine: Engine, index: int, token: int) -> None:
        self.emit("token", rank=0, id=engine.requests[index].id, token=token)

    def finished(self, engine: Engine, index: int, timing: Timing, now: float) -> None:
        state = engine.schedule.requests[index]
        self.emit(
            "finished",
            rank=0,
            id=engine.requests[index].id,
            finish_reason=state.finish_reason,
            prompt_tokens=len(state.prompt),
            cached_tokens=state.cached,
            generation_tokens=len(state.generated),
        )


class TextReporter:
    """``generate`` and ``chat``: rank 0 streams text as mlx-lm's ``stream_generate`` does.

    Each token's new text goes out as a ``token`` event as soon as it is
    sampled (the end-of-sequence token shows no text); the timing figures of
    the one request are kept for the ``done`` event.
    """

    def __init__(self, emit: Callable[..., None], tokenizer: Any, request_id: Any = None) -> None:
        self.emit, self.request_id = emit, request_id
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.figures: dict[str, Any] = {}

    def token(self, engine: Engine, index: int, token: int) -> None:
        if token in engine.eos.get(index, self.eos_ids):  # the request's own, --extra-eos-token included
            return
        self.detokenizer.add_token(token)
        self._send(self.detokenizer.last_segment, token)

    def finished(self, engine: Engine, index: int, timing: Timing, now: float) -> None:
        self.detokenizer.finalize()
        self._send(self.detokenizer.last_segment, None)
        state = engine.schedule.requests[index]
        first = timing.first_token or now
        fed = len(state.prompt) - state.cached
        self.figures = {
            # As stream_generate: the tokens fed over the time to the first token, then
            # every token over the time after the first.
            "prompt_tps": fed / (first - timing.admitted) if first > timing.admitted else 0.0,
            "generation_tps": len(state.generated) / (now - first) if now > first else 0.0,
            "ttft": first - timing.admitted,
        }

    def _send(self, text: str, token: int | None) -> None:
        if not text and token is None:
            return  # every shown token gets its event; the end only when text is left
        fields: dict[str, Any] = {"text": text, "token": token}
        if self.request_id is not None:
            fields["id"] = self.request_id
        self.emit("token", **fields)
