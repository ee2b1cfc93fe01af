"""The rank loop: one rank's answers to the controller's messages, until ``exit``.

Every rank reads the same messages (``mlx.launch`` broadcasts standard input)
and runs the same generation, so every collective lines up. ``generate``: rank 0
alone streams ``token`` events; every rank ends the request with ``done``.
``batch``: the requests overlap across the stages in the ``engine``; rank 0 emits
a ``result`` per request, every rank ends with ``batch_done``. ``serve`` hands the
rest of standard input to the engine (``mlxpipe serve``): ``submit`` and
``cancel`` messages, applied by every rank at the same tick, until ``exit``; rank 0
emits every sampled ``token`` and a ``finished`` per request. One request on one
rank, ``--pipeline native`` and a draft model run requests one at a time through
mlx-lm's ``stream_generate`` instead (``streamed``): ``RankLoop.runs_streamed``
makes that choice, in one place, for every message.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from mlxpipe.errors import MlxpipeError, UsageError
from mlxpipe.model.facts import text_config_of
from mlxpipe.prompts import prompt_tokens
from mlxpipe.protocol import wire
from mlxpipe.protocol.events import BatchDone, Bye, Done, Serving, Time
from mlxpipe.protocol.job import JobSpec
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import Batch, Exit, Generate, Serve
from mlxpipe.protocol.request import Request
from mlxpipe.worker.agree import shared_seed
from mlxpipe.worker.caches.disk_cache import DiskCache, slice_identity
from mlxpipe.worker.context import RankContext
from mlxpipe.worker.generation.engine import Engine
from mlxpipe.worker.generation.reporters import BatchReporter, StreamReporter, TextReporter
from mlxpipe.worker.generation.streamed import Streamed
from mlxpipe.worker.groups import init_group
from mlxpipe.worker.inbox import Inbox
from mlxpipe.worker.load import LoadedModel, barrier, load_rank, loaded_event
from mlxpipe.worker.progress import Emit, Progress

if TYPE_CHECKING:
    from collections.abc import Callable


def run(job_text: str, stream: IO[str] | None = None, emit: Emit = wire.emit) -> None:
    """Join the group, load this rank's layers, then answer the messages from ``stream``."""
    job = JobSpec.decode(job_text)
    group = init_group(job.world_size)
    loaded = load_rank(job, group)
    emit(loaded_event(job, group, loaded))
    RankLoop(loaded, group, job, emit).run(stream or sys.stdin)


class RankLoop:
    """Answers ``generate``, ``batch``, ``serve`` and ``exit`` on one rank (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, group: mx.distributed.Group, job: JobSpec, emit: Emit = wire.emit) -> None:
        self.loaded = loaded
        self.group = group
        self.job = job
        self.rank = group.rank()
        self.host = socket.gethostname()
        self._emit = emit
        self._chat_cache: LRUPromptCache | None = None  # the engine's chat turns
        self._disk_cache: DiskCache | None = None  # serving: the prompt cache's disk tier on this rank
        self.progress = Progress(emit, self.rank)
        self.context = RankContext(loaded, group, job, self.progress)
        self.streamed = Streamed(self.context, emit)  # stream_generate's requests, and its chat turns

    def run(self, stream: IO[str]) -> None:
        """Answer the messages from ``stream`` until ``exit`` or end of input."""
        inbox = Inbox(stream)
        while True:
            message = inbox.next()
            if message is None or isinstance(message, Exit):
                self.exit()
                return
            if isinstance(message, Batch):
                self.generate_batch(message)
            elif isinstance(message, Generate):
                self.generate(message.request)
            elif isinstance(message, Serve):
                self.serve(message, inbox)
                self.exit()
                return
            else:
                raise UsageError(f"a {message.TAG!r} message to a rank that serves requests")

    def exit(self) -> None:
        """Wait for every rank, so no rank sees its peer vanish, then say bye."""
        barrier(self.group)
        self._emit(Bye(rank=self.rank, host=self.host))

    def runs_streamed(self, kind: Literal["generate", "batch", "serve"]) -> bool:
        """Whether this rank runs a ``kind`` message's requests through ``streamed`` (mlx-lm's ``stream_generate``,
        one request at a time) rather than the ``engine``: the one choice between the two generation paths.

        Why each exists: the engine overlaps requests across a generic pipeline's stages in lockstep ticks (every
        stage busy at once, decode steps batched, a prompt's prefill chunks flowing through every host at once), and
        it alone feeds a vision-language model the image embeddings and position ids of its prompts. ``streamed`` is
        mlx-lm's own generation: a draft model's speculative decoding, which mlx-lm does not batch, for every
        message; and one ``generate`` request where nothing would overlap (one rank) or where the model's own
        ``pipeline()`` cuts it (``--pipeline native``: no stand-ins for the engine to drive). Many requests (a batch,
        a server) run in the engine, on one rank too.
        """
        if self.loaded.draft is not None:
            return True
        if kind != "generate":
            return False
        # One request: the engine where a generic pipeline's stages overlap its chunks, or for a vision model.
        return self.job.mode != "generic" or not (self.group.size() > 1 or self.loaded.vision)

    def generate(self, request: Request) -> Done:
        """Run one generation; emit its events and return its ``done`` (its path: ``runs_streamed``)."""
        tic = time.perf_counter()
        self.progress.reset()
        try:  # every rank reads the same request: a bad one fails alike everywhere, and only this request
            request = request.check(vocab_size=text_config_of(self.loaded.config).get("vocab_size"))
            tokens = self.prompt_tokens(request)
        except Exception as e:  # noqa: BLE001 - its options, or a chat template that throws on its messages
            done = Done(rank=self.rank, finish_reason="error", error=_reason(e), tokens=[], generation_tokens=0,
                        peak_memory=mx.get_peak_memory() / 1e9, id=request.id)
        else:
            if self.runs_streamed("generate"):
                done = self.streamed.generate(request, tokens, tic)
            else:
                done = self._generate_in_engine(request, tokens)
        self._emit(done)
        return done

    def _generate_in_engine(self, request: Request, tokens: list[int]) -> Done:
        """One request through the engine; a chat keeps its caches for the next turn."""
        if not request.keep_cache:
            self._chat_cache = None
        elif self._chat_cache is None:
            self._chat_cache = LRUPromptCache(max_size=1)  # the last turn: the next one extends it
        if request.temp > 0 and request.seed is None:
            request = replace(request, seed=shared_seed(self.group))
        reporter = TextReporter(self._emit if self.rank == 0 else _no_emit, self.loaded.tokenizer, request.id)
        engine = Engine(self.context, 1, reporter, prompt_cache=self._chat_cache)
        engine.add(request, tokens)
        engine.run()
        state = engine.schedule.requests[0]  # the same on every rank; rank 0 adds its clock's figures
        return Done(
            rank=self.rank,
            prompt_tokens=len(state.prompt) - state.cached,  # as stream_generate: the tokens fed
            cached_tokens=state.cached,
            generation_tokens=len(state.generated),
            finish_reason=state.finish_reason,
            tokens=list(state.generated),
            peak_memory=mx.get_peak_memory() / 1e9,
            id=request.id,
            **reporter.figures,
        )

    def generate_batch(self, batch: Batch) -> BatchDone:
        """Overlap a batch of requests across the stages (see ``engine``); emit ``batch_done``.

        Rank 0 emits a ``result`` for each request as it ends; every rank ends
        with ``batch_done``.
        """
        if self.runs_streamed("batch"):
            self._chat_cache = None
            return self.streamed.batch(batch.requests)
        self._forget_chats()
        engine = Engine(self.context, batch.concurrency, BatchReporter(self._emit), decode_batch=batch.decode_batch)
        for r in batch.requests:
            try:  # a chat template that throws on one prompt's messages fails that prompt alone, on every rank
                tokens = self.prompt_tokens(r)
            except Exception as e:  # noqa: BLE001
                engine.refuse(r, _reason(e))
                continue
            engine.add(r, tokens)
        done = engine.run()
        self._emit(done)
        return done

    def serve(self, message: Serve, inbox: Inbox) -> None:
        """Serve the requests that follow in ``inbox`` as they come (``mlxpipe serve``), until ``exit``.

        Requests arrive as token ids (the controller applies the chat template);
        rank 0 streams each sampled token. Up to ``message.concurrency`` run at once, the
        rest wait for a slot.
        """
        if self.runs_streamed("serve"):
            self._chat_cache = None
            self.streamed.serve(inbox)
            return
        self._forget_chats()
        disk_tier = bool(message.prompt_cache_dirs) and message.prompt_cache_gb > 0
        self._disk_cache, disk_error = self._open_disk_cache(message) if disk_tier else (None, None)
        engine = Engine(self.context, message.concurrency, StreamReporter(self._emit), message.prompt_cache_size,
                        decode_batch=message.decode_batch, disk_cache=self._disk_cache, disk_tier=disk_tier,
                        prefill_budget=message.prefill_budget)
        engine.on_time = self._report_time
        if self.rank == 0 and engine.vocab_size:
            self._warm_constraints(engine.vocab_size)
        folder = self._disk_cache.folder if self._disk_cache is not None else None
        self._emit(Serving(rank=self.rank, concurrency=message.concurrency, decode_batch=engine.decode_batch,
                           prompt_cache_dir=str(folder) if folder is not None else None,
                           prompt_cache_error=disk_error))
        try:
            engine.run(inbox)
        finally:
            engine.prompt_caches.close()  # what the writer has queued is written before the rank says bye

    def _open_disk_cache(self, message: Serve) -> tuple[DiskCache | None, str | None]:
        """This rank's disk tier, or why it has none (then it never offers a hit: its peers miss too)."""
        dirs = message.prompt_cache_dirs or []
        if len(dirs) != self.group.size():
            raise UsageError(f"the serve message names {len(dirs)} prompt cache directories for "
                             f"{self.group.size()} ranks")
        directory = Path(dirs[self.rank]).expanduser()
        identity = slice_identity(self.job, self.rank, (self.loaded.start, self.loaded.end), self.loaded.sharding)
        try:
            return DiskCache(directory, int(message.prompt_cache_gb * 1e9), identity), None
        except OSError as e:
            return None, f"{directory}: {e.strerror or e}"

    def _report_time(self, spent: dict[str, float]) -> None:
        """Where the time went, with the rank's memory, for the server's page (figures in GB, as in ``loaded``)."""
        disk = self._disk_cache.figures() if self._disk_cache is not None else None
        self._emit(Time(rank=self.rank, memory=mx.get_active_memory() / 1e9, peak_memory=mx.get_peak_memory() / 1e9,
                        disk_cache=disk, **spent))

    def _warm_constraints(self, vocab_size: int) -> None:
        """llguidance's tokenizer takes a second or two to build: built aside now, not at the first
        ``response_format`` request, in the middle of every request's ticks. Without llguidance, nothing."""
        from mlxpipe.worker.generation.constraints import warm

        tokenizer = self.loaded.tokenizer
        threading.Thread(target=_quietly, args=(warm, tokenizer, vocab_size, set(tokenizer.eos_token_ids)),
                         daemon=True, name="mlxpipe-grammar-warm").start()

    def prompt_tokens(self, request: Request) -> list[int]:
        """The request's prompt as token ids, through the chat template if any."""
        return prompt_tokens(self.loaded.tokenizer, request)

    def _forget_chats(self) -> None:
        """A batch, or serving, does not continue a chat: drop the caches kept for the next turn."""
        self.streamed.forget()
        self._chat_cache = None


def _reason(e: BaseException) -> str:
    """What a failed request's client is told."""
    return e.message if isinstance(e, MlxpipeError) else f"{type(e).__name__}: {e}"


def _quietly(work: Callable[..., object], *args: object) -> None:
    """Work aside whose failure only means it is done later, where its error reaches the request."""
    try:
        work(*args)
    except Exception:  # noqa: BLE001 - a constrained request rebuilds it and fails with the reason
        pass


def _no_emit(event: Event) -> None:
    """Only rank 0 streams text."""
