"""Requests through mlx-lm's ``stream_generate``, one at a time: one rank, ``--pipeline native``, a draft model.

Every rank runs the same generation, so every collective lines up. With a
draft model (speculative decoding, which mlx-lm does not batch) a batch
(``--prompts-file``) and ``serve`` run here too, one request after another, as
mlx_lm.server runs them. A chat keeps its caches for the next turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from mlxpipe.errors import UsageError
from mlxpipe.prompts import prompt_tokens
from mlxpipe.protocol.events import BatchDone, Done, Finished, Result, Serving, Token
from mlxpipe.protocol.messages import Cancel, Exit, Submit
from mlxpipe.protocol.request import Request
from mlxpipe.worker.agree import agreed_min, all_agree, seed_sampling
from mlxpipe.worker.context import RankContext
from mlxpipe.worker.generation.reporters import text_of
from mlxpipe.worker.generation.sampling import extra_eos_ids, logits_processors, mlx_sampler
from mlxpipe.worker.inbox import Inbox
from mlxpipe.worker.load import settle
from mlxpipe.worker.progress import Emit

if TYPE_CHECKING:
    from mlx_lm.generate import GenerationResponse


@dataclass
class _PromptCache:
    """A cache and the exact tokens it holds, kept between chat turns."""

    cache: list[Any]
    tokens: list[int]


class Streamed:
    """One rank's requests through ``stream_generate``, and the caches a chat keeps between turns."""

    def __init__(self, context: RankContext, emit: Emit) -> None:
        self.context, self._emit = context, emit
        self.rank = context.group.rank()
        self._prompt_cache: _PromptCache | None = None  # the last chat turn's

    def forget(self) -> None:
        """Drop the last chat turn's caches (a batch, or serving, does not continue a chat)."""
        self._prompt_cache = None

    def generate(self, request: Request, tokens: list[int], tic: float,
                 on_response: Callable[[GenerationResponse], None] | None = None) -> Done:
        """One request through mlx-lm's ``stream_generate`` (one rank, ``--pipeline native``, a draft model);
        each response goes to ``on_response`` (default: rank 0 streams its text)."""
        tokenizer = self.context.loaded.tokenizer
        keep = request.keep_cache
        if self.context.loaded.draft is None:
            cache, cached = self._cache_for(tokens, keep, request.max_kv_size)
            draft: dict[str, Any] = {}
        else:
            # speculative_generate_step: the target verifies num_draft_tokens draft tokens in one
            # pass through the stages; every rank drafts the same tokens with its own copy.
            cache, cached = self._speculative_cache_for(tokens, keep)
            draft = {"draft_model": self.context.loaded.draft,
                     "num_draft_tokens": request.num_draft_tokens or self.context.job.num_draft_tokens}
        seed_sampling(self.context.group, request.seed, request.temp)
        eos = set(tokenizer.eos_token_ids)
        extra = extra_eos_ids(tokenizer, request.extra_eos_token)
        generated: list[int] = []
        drafted = 0
        ttft = None
        response = None
        tokenizer.eos_token_ids = eos | extra  # as mlx_lm.generate's add_eos_token, for this request only
        try:
            for response in stream_generate(
                self.context.loaded.model,
                tokenizer,
                mx.array(tokens[cached:]),
                max_tokens=request.max_tokens,
                sampler=mlx_sampler(request, tokenizer, eos | extra),
                logits_processors=logits_processors(request),
                prompt_cache=cache,
                prefill_step_size=self.context.job.prefill_step_size,
                prompt_progress_callback=self.context.progress.prefill,
                **request.kv_kwargs(),
                **draft,
            ):
                if ttft is None:
                    ttft = time.perf_counter() - tic
                generated.append(response.token)
                drafted += response.from_draft
                self.context.progress.decode(len(generated))
                if on_response is None:
                    self._emit_token(request, response)
                else:
                    on_response(response)
        finally:
            tokenizer.eos_token_ids = eos
        assert response is not None  # stream_generate always yields once
        # generate_step computes one step ahead; let it finish before any other
        # collective (CPU-stream barriers, seeds) can interleave with its ops.
        settle()

        # Every token stream_generate yields has been fed to the cache (speculative decoding:
        # perhaps not the last ones, and rejected drafts' positions: _speculative_cache_for trims).
        self._prompt_cache = _PromptCache(cache, tokens + generated) if keep else None
        return Done(
            rank=self.rank,
            prompt_tokens=response.prompt_tokens,
            cached_tokens=cached,
            prompt_tps=response.prompt_tps,
            generation_tokens=response.generation_tokens,
            generation_tps=response.generation_tps,
            ttft=ttft,
            finish_reason=response.finish_reason,
            tokens=generated,
            draft_tokens=drafted if draft else None,
            peak_memory=mx.get_peak_memory() / 1e9,
            id=request.id,
        )

    def serve(self, inbox: Inbox) -> None:
        """With a draft model, requests run one after another, as mlx_lm.server runs them (speculative
        decoding is not batched), each continuing the last one's caches where their tokens agree.

        Before each request the ranks agree how many messages they all hold, queue the submits and drop
        the queued requests that were cancelled; a cancel of the running request takes effect at its end
        (the controller has dropped its stream already).
        """
        self._prompt_cache = None
        self._emit(Serving(rank=self.rank, concurrency=1, decode_batch=1))
        queue: list[Request] = []
        while True:
            if not queue:
                inbox.wait_beyond(inbox.consumed)
            for message in inbox.take(agreed_min(self.context.group, inbox.received)):
                if message is None or isinstance(message, Exit):
                    return
                if isinstance(message, Submit):
                    if not self._refused(message.request):
                        queue.append(message.request)
                elif isinstance(message, Cancel):
                    queue = [r for r in queue if r.id != message.id]
                else:
                    raise UsageError(f"a {message.TAG!r} message while serving: only submit, cancel and exit")
            if queue:
                self._speculate(queue.pop(0))

    def _refused(self, request: Request) -> bool:
        """Speculative decoding samples inside mlx-lm's ``speculative_generate_step``, where no grammar mask or
        logprobs of ours reach: such a request ends at once (the server refuses it before; this is the net)."""
        if not request.constrained and not request.logprobs:
            return False
        if self.rank == 0:
            self._emit(Finished(rank=0, id=request.id, finish_reason="error", prompt_tokens=0, cached_tokens=0,
                                generation_tokens=0,
                                error="response_format, enforced tool calls and logprobs are not supported with a "
                                      "draft model"))
        return True

    def _speculate(self, request: Request) -> None:
        """One served request through ``stream_generate`` with the draft model; rank 0 streams its token ids."""
        tokens = [int(t) for t in request.tokens or ()]
        self.context.progress.reset()

        def stream(response: GenerationResponse) -> None:
            if self.rank == 0:
                self._emit(Token(rank=0, id=request.id, token=response.token))

        done = self.generate(replace(request, keep_cache=True), tokens, time.perf_counter(), stream)
        if self.rank == 0:
            self._emit(Finished(rank=0, id=request.id, finish_reason=done.finish_reason, prompt_tokens=len(tokens),
                                cached_tokens=done.cached_tokens, generation_tokens=done.generation_tokens))

    def batch(self, requests: tuple[Request, ...]) -> BatchDone:
        """``--prompts-file`` with a draft model: one prompt after another through speculative decoding
        (it is not batched); rank 0 emits each ``result``, every rank ``batch_done``."""
        tic = time.perf_counter()
        self._prompt_cache = None
        generated = 0
        for index, request in enumerate(requests):
            tokens = prompt_tokens(self.context.loaded.tokenizer, request)
            started = time.perf_counter()
            self.context.progress.reset()
            done = self.generate(replace(request, keep_cache=False), tokens, started, lambda r: None)
            generated += done.generation_tokens
            if self.rank == 0:
                tokenizer = self.context.loaded.tokenizer
                eos = set(tokenizer.eos_token_ids) | extra_eos_ids(tokenizer, request.extra_eos_token)
                self._emit(Result(rank=0, index=index, id=request.id if request.id is not None else index,
                                  tokens=done.tokens, text=text_of(tokenizer, done.tokens, eos),
                                  prompt_tokens=len(tokens), generation_tokens=done.generation_tokens,
                                  finish_reason=done.finish_reason, ttft=done.ttft or 0.0,
                                  latency=time.perf_counter() - started, generation_tps=done.generation_tps,
                                  draft_tokens=done.draft_tokens))
        summary = BatchDone(rank=self.rank, requests=len(requests), concurrency=1, generation_tokens=generated,
                            seconds=time.perf_counter() - tic, peak_memory=mx.get_peak_memory() / 1e9, decode_batch=1)
        self._emit(summary)
        return summary

    def _emit_token(self, request: Request, response: GenerationResponse) -> None:
        """Rank 0 streams text; the end-of-sequence token itself is not shown."""
        if self.rank != 0:
            return
        stop = response.finish_reason == "stop"
        if stop and not response.text:
            return
        self._emit(Token(rank=0, text=response.text, token=None if stop else response.token, id=request.id))

    def _cache_for(self, tokens: list[int], keep: bool, max_kv_size: int | None = None) -> tuple[list[Any], int]:
        """A cache for ``tokens`` and how many of them it already holds."""
        previous, self._prompt_cache = self._prompt_cache, None
        common = extra = 0
        usable = False
        if keep and previous is not None:
            # At least one token must be fed to get logits for the next one.
            common = min(common_prefix_len(previous.tokens, tokens), len(tokens) - 1)
            extra = len(previous.tokens) - common
            usable = _cache_length(previous.cache) in (None, len(previous.tokens)) and (
                extra == 0 or can_trim_prompt_cache(previous.cache)
            )
        # Ranks hold different caches (native mode keeps only local ones), so
        # they agree before anyone trims: all must feed the same tokens.
        if keep and all_agree(self.context.group, usable):
            assert previous is not None  # usable on every rank, this one too
            # mlx-lm annotates trim_prompt_cache as returning a list: it returns the count trimmed.
            if extra == 0 or cast(int, trim_prompt_cache(previous.cache, extra)) == extra:
                return previous.cache, common
        return make_prompt_cache(self.context.loaded.model, max_kv_size=max_kv_size or self.context.job.max_kv_size), 0

    def _speculative_cache_for(self, tokens: list[int], keep: bool) -> tuple[list[Any], int]:
        """The model's caches then the draft's (as ``speculative_generate_step`` splits them), and how many
        of ``tokens`` they hold.

        Speculative decoding may leave positions of rejected drafts, or miss the last tokens, at the
        caches' ends; the positions before are right. A chat turn keeps the prefix it shares with the
        last turn's tokens and the shorter of the two caches, and trims both to it (both are trimmable:
        mlx-lm checks).
        """
        previous, self._prompt_cache = self._prompt_cache, None
        split = len(self.context.loaded.model.layers)
        parts = [previous.cache[:split], previous.cache[split:]] if keep and previous is not None else []
        lengths = [_cache_length(part) for part in parts]
        common = 0
        known = [length for length in lengths if length is not None]
        if previous is not None and parts and len(known) == len(lengths):
            common = min(common_prefix_len(previous.tokens, tokens), len(tokens) - 1, *known)
        common = agreed_min(self.context.group, common)  # every rank must feed the same tokens
        if common > 0:
            assert previous is not None  # common > 0 on every rank: this one kept its caches
            for part, length in zip(parts, known, strict=True):
                trim_prompt_cache(part, length - common)
            return previous.cache, common
        draft = self.context.loaded.draft
        assert draft is not None  # only speculative requests come here
        return make_prompt_cache(self.context.loaded.model) + make_prompt_cache(draft), 0


def _cache_length(cache: list[Any]) -> int | None:
    """The number of tokens in the cache, from the first cache that counts them."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
        for sub in getattr(c, "caches", ()):
            offset = getattr(sub, "offset", None)
            if isinstance(offset, int):
                return offset
    return None
