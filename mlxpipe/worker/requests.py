"""The request loop of one rank: generate with mlx-lm, report through events.

Every rank reads the same requests (``mlx.launch`` broadcasts standard input)
and runs the same generation, so every collective lines up. Rank 0 alone
streams ``token`` events; every rank ends a request with ``done``. A ``batch``
request overlaps many requests across the stages (``engine``): rank 0 emits
a ``result`` per request, every rank ends with ``batch_done``. A ``serve``
request hands the rest of standard input to the engine (``mlxpipe serve``):
``submit`` and ``cancel`` messages, applied by every rank at the same tick, until
``exit``; rank 0 emits every sampled ``token`` and a ``finished`` per request.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import IO, Any, Callable

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from mlxpipe import protocol
from mlxpipe.errors import LaunchError, MlxpipeError, UsageError
from mlxpipe.model.facts import text_config_of
from mlxpipe.prompts import prompt_tokens
from mlxpipe.request import Request
from mlxpipe.worker.engine import BatchReporter, Engine, StreamReporter, TextReporter, text_of
from mlxpipe.worker.sampling import extra_eos_ids, logits_processors, mlx_sampler
from mlxpipe.worker.inbox import Inbox
from mlxpipe.worker.job import JobSpec
from mlxpipe.worker.load import LoadedModel, barrier, load_rank, settle

PROGRESS_SECONDS = 1.0  # the most often a rank reports decode progress: the controller's stall watchdog
Emit = Callable[..., None]


class Progress:
    """This rank's ``progress`` events, which feed the controller's stall watchdog.

    ``step`` counts units of work of the current request (prefill chunks, then
    tokens, or ticks); every rank does the same steps, so a rank whose step lags
    the others' is the one waiting. A reporter thread sends the latest step at
    most every ``PROGRESS_SECONDS``, and soon after the rank stops advancing, so
    a stuck rank's last report is exactly where it stands (MLX releases the GIL
    while it waits in a collective).
    """

    def __init__(self, emit: Emit, rank: int) -> None:
        self._emit, self.rank = emit, rank
        self.step, self.what = 0, "idle"
        self._sent: tuple[int, str] | None = None
        self._sent_at = self._changed_at = 0.0
        self._lock = threading.Lock()
        threading.Thread(target=self._report, daemon=True, name="mlxpipe-progress").start()

    def reset(self) -> None:
        self._set(0, "idle")

    def prefill(self, done: int, total: int) -> None:
        self._set(self.step + 1, f"prefill {done}/{total} tokens")

    def decode(self, tokens: int) -> None:
        self._set(self.step + 1, f"decode token {tokens}")

    def tick(self, tick: int, doing: str) -> None:
        """The engine's ticks: the same on every rank, so a lagging tick is the waiting rank."""
        self._set(tick, f"{doing} (tick {tick})")

    def _set(self, step: int, what: str) -> None:
        with self._lock:
            self.step, self.what, self._changed_at = step, what, time.monotonic()

    def _report(self) -> None:
        while True:
            time.sleep(PROGRESS_SECONDS / 4)
            now = time.monotonic()
            with self._lock:
                current = (self.step, self.what)
                due = current != self._sent and (
                    now - self._sent_at >= PROGRESS_SECONDS or now - self._changed_at >= PROGRESS_SECONDS / 2
                )
                if due:
                    self._sent, self._sent_at = current, now
            if due:
                self._emit("progress", rank=self.rank, what=current[1], step=current[0])


@dataclass
class _PromptCache:
    """A cache and the exact tokens it holds, kept between chat turns."""

    cache: list[Any]
    tokens: list[int]


def run(job_text: str, stream: IO[str] | None = None, emit: Emit = protocol.emit) -> None:
    """Join the group, load this rank's layers, then serve requests from ``stream``."""
    job = JobSpec.decode(job_text)
    group = init_group(job.world_size)
    loaded = load_rank(job, group)
    emit("loaded", **loaded_fields(job, group, loaded))
    Server(loaded, group, job, emit).serve(stream or sys.stdin)


def loaded_fields(job: JobSpec, group: Any, loaded: LoadedModel) -> dict[str, Any]:
    """What a rank's ``loaded`` event says (serving and training ranks alike)."""
    return {
        "rank": group.rank(),
        "host": socket.gethostname(),
        "layers": [loaded.start, loaded.end],
        "num_layers": sum(job.split),
        "mode": job.mode,
        "peak_memory": mx.get_peak_memory() / 1e9,
        "load_seconds": loaded.load_seconds,
    }


def init_group(world_size: int) -> Any:
    """The distributed group of the job; a single rank needs no backend."""
    if world_size == 1:
        # mlx.launch gives a lone rank an empty hostfile, which the ring
        # backend fails to parse even when not strict.
        os.environ.pop("MLX_HOSTFILE", None)
    group = mx.distributed.init(strict=world_size > 1)
    if group.size() != world_size:
        raise LaunchError(
            f"the job is for {world_size} ranks but mlx.launch started {group.size()}",
            hint="the hostfile and the job must list the same hosts",
        )
    return group


class Server:
    """Answers ``generate`` and ``exit`` requests on one rank."""

    def __init__(
        self, loaded: LoadedModel, group: Any, job: JobSpec, emit: Emit = protocol.emit
    ) -> None:
        self.loaded = loaded
        self.group = group
        self.job = job
        self.rank = group.rank()
        self.host = socket.gethostname()
        self._emit = emit
        self._prompt_cache: _PromptCache | None = None  # stream_generate's chat turns
        self._chat_cache: LRUPromptCache | None = None  # the engine's chat turns
        self.progress = Progress(emit, self.rank)

    def serve(self, stream: IO[str]) -> None:
        """Handle requests from ``stream`` until ``exit`` or end of input."""
        inbox = Inbox(stream)
        while True:
            request = inbox.next()
            kind = "exit" if request is None else request.get("type")
            if kind == "exit":
                self.exit()
                return
            if kind == "batch":
                self.generate_batch(request)
            elif kind == "generate":
                self.generate(Request.from_wire(request))
            elif kind == "serve":
                self.serve_requests(request, inbox)
                self.exit()
                return
            else:
                raise UsageError(f"unknown request type {kind!r}")

    def exit(self) -> None:
        """Wait for every rank, so no rank sees its peer vanish, then say bye."""
        barrier(self.group)
        self._emit("bye", rank=self.rank, host=self.host)

    def generate(self, request: Request) -> dict[str, Any]:
        """Run one generation; emit its events and return the ``done`` fields.

        A generic pipeline runs it through the engine, so the prompt's prefill
        chunks flow through the stages one behind the other and every host
        prefills at once; one rank, the model's own ``pipeline()``, or a draft
        model (speculative decoding) runs mlx-lm's ``stream_generate``.
        """
        tic = time.perf_counter()
        self.progress.reset()
        try:  # every rank reads the same request: a bad one fails alike everywhere, and only this request
            request = request.check(vocab_size=text_config_of(self.loaded.config).get("vocab_size"))
            tokens = self.prompt_tokens(request)
        except Exception as e:  # noqa: BLE001 - its options, or a chat template that throws on its messages
            done = {"finish_reason": "error", "error": _reason(e), "tokens": [], "generation_tokens": 0}
        else:
            if self.job.mode == "generic" and self.group.size() > 1 and self.loaded.draft is None:
                done = self._generate_in_engine(request, tokens)
            else:
                done = self._generate_stream(request, tokens, tic)
        done = {"rank": self.rank, **done, "peak_memory": mx.get_peak_memory() / 1e9}
        if request.id is not None:
            done["id"] = request.id
        self._emit("done", **done)
        return done

    def _generate_in_engine(self, request: Request, tokens: list[int]) -> dict[str, Any]:
        """One request through the engine; a chat keeps its caches for the next turn."""
        if not request.keep_cache:
            self._chat_cache = None
        elif self._chat_cache is None:
            self._chat_cache = LRUPromptCache(max_size=1)  # the last turn: the next one extends it
        if request.temp > 0 and request.seed is None:
            request = replace(request, seed=self._shared_seed())
        reporter = TextReporter(self._emit if self.rank == 0 else _no_emit, self.loaded.tokenizer, request.id)
        engine = Engine(self, 1, reporter, prompt_cache=self._chat_cache)
        engine.add(request, tokens)
        engine.run()
        state = engine.schedule.requests[0]  # the same on every rank; rank 0 adds its clock's figures
        done = {
            "prompt_tokens": len(state.prompt) - state.cached,  # as stream_generate: the tokens fed
            "cached_tokens": state.cached,
            "generation_tokens": len(state.generated),
            "finish_reason": state.finish_reason,
            "tokens": list(state.generated),
        }
        return {**done, **reporter.figures}

    def _generate_stream(self, request: Request, tokens: list[int], tic: float,
                         on_response: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """One request through mlx-lm's ``stream_generate`` (one rank, ``--pipeline native``, a draft model);
        each response goes to ``on_response`` (default: rank 0 streams its text)."""
        tokenizer = self.loaded.tokenizer
        keep = request.keep_cache
        if self.loaded.draft is None:
            cache, cached = self._cache_for(tokens, keep, request.max_kv_size)
            draft = {}
        else:
            # speculative_generate_step: the target verifies num_draft_tokens draft tokens in one
            # pass through the stages; every rank drafts the same tokens with its own copy.
            cache, cached = self._speculative_cache_for(tokens, keep)
            draft = {"draft_model": self.loaded.draft,
                     "num_draft_tokens": request.num_draft_tokens or self.job.num_draft_tokens}
        self._seed(request.seed, request.temp)
        eos = set(tokenizer.eos_token_ids)
        extra = extra_eos_ids(tokenizer, request.extra_eos_token)
        generated: list[int] = []
        drafted = 0
        ttft = None
        response = None
        tokenizer.eos_token_ids = eos | extra  # as mlx_lm.generate's add_eos_token, for this request only
        try:
            for response in stream_generate(
                self.loaded.model,
                tokenizer,
                mx.array(tokens[cached:]),
                max_tokens=request.max_tokens,
                sampler=mlx_sampler(request, tokenizer, eos | extra),
                logits_processors=logits_processors(request),
                prompt_cache=cache,
                prefill_step_size=self.job.prefill_step_size,
                prompt_progress_callback=self.progress.prefill,
                **request.kv_kwargs(),
                **draft,
            ):
                if ttft is None:
                    ttft = time.perf_counter() - tic
                generated.append(response.token)
                drafted += response.from_draft
                self.progress.decode(len(generated))
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
        return {
            "prompt_tokens": response.prompt_tokens,
            "cached_tokens": cached,
            "prompt_tps": response.prompt_tps,
            "generation_tokens": response.generation_tokens,
            "generation_tps": response.generation_tps,
            "ttft": ttft,
            "finish_reason": response.finish_reason,
            "tokens": generated,
            **({"draft_tokens": drafted} if draft else {}),
        }

    def generate_batch(self, request: dict[str, Any]) -> dict[str, Any]:
        """Overlap a batch of requests across the stages (see ``engine``); emit ``batch_done``.

        Rank 0 emits a ``result`` for each request as it ends; every rank ends
        with ``batch_done``.
        """
        requests = [Request.from_wire(r) for r in request.get("requests") or []]
        if not requests:
            raise UsageError("a batch request needs at least one request")
        if self.loaded.draft is not None:
            return self._batch_one_at_a_time(requests)
        concurrency, decode_batch = self._concurrency(request)
        self._prompt_cache = self._chat_cache = None  # a batch does not continue a chat
        engine = Engine(self, concurrency, BatchReporter(self._emit), decode_batch=decode_batch)
        for r in requests:
            try:  # a chat template that throws on one prompt's messages fails that prompt alone, on every rank
                tokens = self.prompt_tokens(r)
            except Exception as e:  # noqa: BLE001
                engine.refuse(r, _reason(e))
                continue
            engine.add(r, tokens)
        done = engine.run()
        self._emit("batch_done", **done)
        return done

    def serve_requests(self, request: dict[str, Any], inbox: Inbox) -> dict[str, Any]:
        """Serve the requests that follow in ``inbox`` as they come (``mlxpipe serve``), until ``exit``.

        Requests arrive as token ids (the controller applies the chat template);
        rank 0 streams each sampled token. Up to ``concurrency`` run at once, the
        rest wait for a slot.
        """
        if self.loaded.draft is not None:
            return self._serve_one_at_a_time(inbox)
        concurrency, decode_batch = self._concurrency(request)
        self._prompt_cache = self._chat_cache = None
        engine = Engine(self, concurrency, StreamReporter(self._emit), int(request.get("prompt_cache_size", 0)),
                        decode_batch=decode_batch)
        engine.on_time = lambda spent: self._emit("time", rank=self.rank, **spent)
        self._emit("serving", rank=self.rank, concurrency=concurrency, decode_batch=engine.decode_batch)
        return engine.run(inbox)

    def _serve_one_at_a_time(self, inbox: Inbox) -> dict[str, Any]:
        """With a draft model, requests run one after another, as mlx_lm.server runs them (speculative
        decoding is not batched), each continuing the last one's caches where their tokens agree.

        Before each request the ranks agree how many messages they all hold, queue the submits and drop
        the queued requests that were cancelled; a cancel of the running request takes effect at its end
        (the controller has dropped its stream already).
        """
        self._prompt_cache = self._chat_cache = None
        self._emit("serving", rank=self.rank, concurrency=1, decode_batch=1)
        queue: list[Request] = []
        while True:
            if not queue:
                inbox.wait_beyond(inbox.consumed)
            for message in inbox.take(self._agreed_min(inbox.received)):
                kind = "exit" if message is None else message.get("type")
                if kind == "exit":
                    return {}
                if kind == "submit":
                    queue.append(Request.from_wire(message))
                elif kind == "cancel":
                    queue = [r for r in queue if r.id != message.get("id")]
                else:
                    raise UsageError(f"unknown message {kind!r} while serving")
            if queue:
                self._speculate(queue.pop(0))

    def _speculate(self, request: Request) -> None:
        """One served request through ``stream_generate`` with the draft model; rank 0 streams its token ids."""
        tokens = [int(t) for t in request.tokens or ()]
        self.progress.reset()

        def stream(response: Any) -> None:
            if self.rank == 0:
                self._emit("token", rank=0, id=request.id, token=response.token)

        done = self._generate_stream(replace(request, keep_cache=True), tokens, time.perf_counter(), stream)
        if self.rank == 0:
            self._emit("finished", rank=0, id=request.id, finish_reason=done["finish_reason"],
                       prompt_tokens=len(tokens), cached_tokens=done["cached_tokens"],
                       generation_tokens=done["generation_tokens"])

    def _batch_one_at_a_time(self, requests: list[Request]) -> dict[str, Any]:
        """``--prompts-file`` with a draft model: one prompt after another through speculative decoding
        (it is not batched); rank 0 emits each ``result``, every rank ``batch_done``."""
        tic = time.perf_counter()
        self._prompt_cache = self._chat_cache = None
        generated = 0
        for index, request in enumerate(requests):
            tokens = self.prompt_tokens(request)
            started = time.perf_counter()
            self.progress.reset()
            done = self._generate_stream(replace(request, keep_cache=False), tokens, started, lambda r: None)
            generated += done["generation_tokens"]
            if self.rank == 0:
                eos = set(self.loaded.tokenizer.eos_token_ids) | extra_eos_ids(self.loaded.tokenizer,
                                                                               request.extra_eos_token)
                self._emit("result", rank=0, index=index, id=request.id if request.id is not None else index,
                           tokens=done["tokens"], text=text_of(self.loaded.tokenizer, done["tokens"], eos),
                           prompt_tokens=len(tokens), generation_tokens=done["generation_tokens"],
                           finish_reason=done["finish_reason"], ttft=done["ttft"],
                           latency=time.perf_counter() - started, generation_tps=done["generation_tps"],
                           draft_tokens=done["draft_tokens"])
        done = {"rank": self.rank, "requests": len(requests), "concurrency": 1, "generation_tokens": generated,
                "seconds": time.perf_counter() - tic, "peak_memory": mx.get_peak_memory() / 1e9, "decode_batch": 1}
        self._emit("batch_done", **done)
        return done

    def _concurrency(self, request: dict[str, Any]) -> tuple[int, int]:
        """A batch or serve request's concurrency and requests per decode micro-batch."""
        decode_batch = int(request.get("decode_batch") or 1)
        concurrency = int(request.get("concurrency") or self.group.size() * decode_batch)
        if concurrency < 1 or decode_batch < 1:
            raise UsageError(f"concurrency and decode_batch must be at least 1, got {concurrency} and {decode_batch}")
        return concurrency, decode_batch

    def _emit_token(self, request: Request, response: Any) -> None:
        """Rank 0 streams text; the end-of-sequence token itself is not shown."""
        if self.rank != 0:
            return
        stop = response.finish_reason == "stop"
        if stop and not response.text:
            return
        fields = {"text": response.text, "token": None if stop else response.token}
        if request.id is not None:
            fields["id"] = request.id
        self._emit("token", **fields)

    def prompt_tokens(self, request: Request) -> list[int]:
        """The request's prompt as token ids, through the chat template if any."""
        return prompt_tokens(self.loaded.tokenizer, request)

    def _cache_for(self, tokens: list[int], keep: bool, max_kv_size: int | None = None) -> tuple[list[Any], int]:
        """A cache for ``tokens`` and how many of them it already holds."""
        previous, self._prompt_cache = self._prompt_cache, None
        common = extra = 0
        usable = keep and previous is not None
        if usable:
            # At least one token must be fed to get logits for the next one.
            common = min(common_prefix_len(previous.tokens, tokens), len(tokens) - 1)
            extra = len(previous.tokens) - common
            usable = _cache_length(previous.cache) in (None, len(previous.tokens)) and (
                extra == 0 or can_trim_prompt_cache(previous.cache)
            )
        # Ranks hold different caches (native mode keeps only local ones), so
        # they agree before anyone trims: all must feed the same tokens.
        if keep and self._all_agree(usable):
            if extra == 0 or trim_prompt_cache(previous.cache, extra) == extra:
                return previous.cache, common
        return make_prompt_cache(self.loaded.model, max_kv_size=max_kv_size or self.job.max_kv_size), 0

    def _speculative_cache_for(self, tokens: list[int], keep: bool) -> tuple[list[Any], int]:
        """The model's caches then the draft's (as ``speculative_generate_step`` splits them), and how many
        of ``tokens`` they hold.

        Speculative decoding may leave positions of rejected drafts, or miss the last tokens, at the
        caches' ends; the positions before are right. A chat turn keeps the prefix it shares with the
        last turn's tokens and the shorter of the two caches, and trims both to it (both are trimmable:
        mlx-lm checks).
        """
        previous, self._prompt_cache = self._prompt_cache, None
        split = len(self.loaded.model.layers)
        parts = [previous.cache[:split], previous.cache[split:]] if keep and previous is not None else []
        lengths = [_cache_length(part) for part in parts]
        common = 0
        if parts and None not in lengths:
            common = min(common_prefix_len(previous.tokens, tokens), len(tokens) - 1, *lengths)
        common = self._agreed_min(common)  # every rank must feed the same tokens
        if common > 0:
            for part, length in zip(parts, lengths):
                trim_prompt_cache(part, length - common)
            return previous.cache, common
        return make_prompt_cache(self.loaded.model) + make_prompt_cache(self.loaded.draft), 0

    def _agreed_min(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (a tiny collective on the CPU)."""
        if self.group.size() == 1:
            return value
        values = mx.distributed.all_gather(mx.array([value]), group=self.group, stream=mx.cpu)
        return int(values.min().item())

    def _all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a tiny collective on the CPU)."""
        return self._agreed_min(int(flag)) == 1

    def _seed(self, seed: int | None, temp: float) -> None:
        """Seed sampling identically on every rank, so every rank picks the same token."""
        if seed is None:
            if temp == 0:
                return  # greedy: no randomness to share
            seed = self._shared_seed()
        mx.random.seed(int(seed))

    def _shared_seed(self) -> int:
        """A random seed drawn by rank 0 and known to every rank."""
        mine = random.getrandbits(31) if self.rank == 0 else 0
        if self.group.size() == 1:
            return mine
        shared = mx.distributed.all_sum(mx.array(mine), group=self.group, stream=mx.cpu)
        return int(shared.item())


def _reason(e: BaseException) -> str:
    """What a failed request's client is told."""
    return e.message if isinstance(e, MlxpipeError) else f"{type(e).__name__}: {e}"


def _no_emit(*args: Any, **kwargs: Any) -> None:
    """Only rank 0 streams text."""


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
