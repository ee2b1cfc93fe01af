"""The serve-side request queue: one pipeline kept up, requests in, tokens out, restarts.

The HTTP server lives in the controller's process, never in a rank, so a rank's
death does not take the API down. A background thread launches the pipeline
(through ``launch.run.launch``, the same sequence every command uses), puts the
ranks into their serving loop (``worker.generation.loop``), and pumps their events:
each token goes to its request's stream as it is sampled. When a rank fails,
``/health`` says ``restarting`` and the thread launches and loads the pipeline
again, up to ``max_restarts`` times with backoff; after that the server gives up
with the root cause.

The requests in flight pause meanwhile and then go on where their clients left
off: each is sent again with the reply's tokens so far after its prompt
(``Request.resume``), which the new ranks prefill (from the prompt cache's disk
tier where it holds the prefix), and rank 0 samples on from the random key and
grammar state it would have had. Its client sees a pause, never an error or a
repeated token. A request waits ``resume_timeout`` seconds for the pipeline to
come back, and is resumed at most ``MAX_RESUMES`` times (a request that fails
its ranks again and again may be their cause); else it ends with the root
cause.

A request that arrives while the pipeline loads or relaunches waits here, and
is sent to the ranks once they are ready (in arrival order), for at most
``queue_timeout`` seconds; when the server gives up, every waiting request
ends at once with the root cause. A request that fails on its own (its
sampler raised on rank 0, say) ends alone, with ``RequestFailed``.

Requests reach the ranks as token ids (the chat template is applied here), so
the ranks only compute; the text, stop strings and tool calls are made here
(``serve.text``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxpipe.defaults import (
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_PREFILL_BUDGET,
    DEFAULT_PROMPT_CACHE_GB,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_RESUME_TIMEOUT,
)
from mlxpipe.errors import LaunchError, MlxpipeError, RequestFailed
from mlxpipe.launch.batch import RankStats
from mlxpipe.launch.config import PipelineConfig
from mlxpipe.launch.pipeline import Pipeline
from mlxpipe.launch.run import launch
from mlxpipe.launch.timing import where_time_goes
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol.events import Finished, Serving, Time, Token
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import Cancel, Exit, Serve, Submit
from mlxpipe.protocol.request import Request
from mlxpipe.serve.stream import Outcome, Resumed, Sampled, Stream

# The wait before each relaunch, for the 1st, 2nd... failure in a row; a pipeline that served STABLE_SECONDS before
# it failed starts the row again (a rare failure costs its requests a pause of 1 s plus the relaunch, not 30 s).
_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_SECONDS = 20.0
_EXPIRY_SECONDS = 0.25  # how often waiting requests are checked against --queue-timeout
MAX_RESUMES = 2  # times one request is continued after its ranks failed; then it ends with the root cause


@dataclass(frozen=True)
class ServeOptions:
    max_concurrency: int
    max_queue: int = DEFAULT_MAX_QUEUE
    max_restarts: int = DEFAULT_MAX_RESTARTS
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    decode_batch: int = 1  # requests per decode micro-batch
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT  # seconds a request waits for the ranks to be ready
    prompt_cache_gb: float = DEFAULT_PROMPT_CACHE_GB  # the disk tier, per rank (0: none)
    prompt_cache_dir: str | None = None  # the disk tier's directory on every host (None: each host's default)
    drain_seconds: float = DEFAULT_DRAIN_SECONDS  # on SIGTERM: how long the requests in flight may take to finish
    resume_timeout: float = DEFAULT_RESUME_TIMEOUT  # a rank failed: how long its requests wait to go on (0: they end)
    prefill_budget: int = DEFAULT_PREFILL_BUDGET  # a prefill chunk's tokens while others decode (0: no bound)


@dataclass
class RankState:
    rank: int
    host: str
    layers: tuple[int, int]
    state: str = "loading"
    peak_memory_gb: float | None = None  # since the rank started: at load, then as each request ends
    memory_gb: float | None = None  # in use when a request last ended
    prompt_cache_dir: str | None = None  # its disk tier's folder (None: none)
    prompt_cache_error: str | None = None  # why it has none, when the server asked for one
    disk_cache: dict[str, float] | None = None  # its disk tier's figures when a request last ended


class RequestQueue:
    """Every door's requests, to the ranks and back, with the pipeline kept up for them (the module docstring)."""

    def __init__(self, config: PipelineConfig, meta: ModelMetadata, plan: Plan, options: ServeOptions,
                 on_state: Callable[[str, str | None], None] | None = None) -> None:
        self.config, self.meta, self.plan, self.options = config, meta, plan, options
        self.state = "loading"
        self.error: MlxpipeError | None = None  # the root cause, once the server gave up
        self.restarts = 0
        self.ranks = [RankState(r.rank, r.host, (r.start, r.end)) for r in plan.ranks]
        self.time: dict[int, dict[str, float]] = {}  # rank -> its latest engine.TimeSpent report
        self.detail: str | None = None  # why the state is what it is (the root cause while restarting, failed)
        self.tokens_out = 0  # tokens streamed since the server started: the page's tok/s
        self.run_dir: Path | None = None
        self.label = ""  # this pipeline's name among a fleet's ("small#1"), in its requests' lines; "" alone
        self.drain_ends: float | None = None  # draining (SIGTERM): when it stops, by time.monotonic(); new requests 503
        self._on_state = on_state or (lambda state, detail: None)
        self._ready_since: float | None = None  # when the pipeline last became ready (None: not since it failed)
        self._in_a_row = 0  # failures in a row (``_backoff``)
        self._streams: dict[str, Stream] = {}  # every live request, waiting ones included
        self._waiting: deque[Stream] = deque()  # not sent to the ranks yet: they are loading or relaunching
        self._lock = threading.Lock()
        self._pipe: Pipeline | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, daemon=True, name="mlxpipe-serve")
        self.finished = threading.Event()  # the run thread has ended (stopped, or gave up)

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        threading.Thread(target=self._expire, daemon=True, name="mlxpipe-queue-timeout").start()

    def stop(self) -> None:
        """End every request, stop every rank (cleanly when it answers), and wait for the run thread."""
        self._stopping.set()
        self._fail_all(LaunchError("the server is shutting down"))
        pipe = self._pipe
        if pipe is not None:
            pipe.ranks.send(Exit())
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=3)
        if pipe is not None:
            pipe.stop()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._serve_once()
                    return  # the ranks exited as asked
                except MlxpipeError as e:
                    if self._stopping.is_set():
                        return
                    self._resume_or_fail(e)  # the requests the ranks had; the waiting ones run after the relaunch
                    if self.restarts >= self.options.max_restarts:
                        self.error = e
                        self._set_state("failed", f"{e.message} (gave up after {self.restarts} restarts)")
                        self._fail_all(e)
                        return
                    self.restarts += 1
                    self._set_state("restarting", e.message)
                    self._stopping.wait(self._backoff())
        finally:
            self.finished.set()

    def _serve_once(self) -> None:
        self.time = {}
        for r in self.ranks:
            r.state = "loading"
        pipe = launch(self.config, self.meta, self.plan, on_loaded=self._loaded)
        self._pipe, self.run_dir = pipe, pipe.run_dir
        try:
            pipe.ranks.send(Serve(concurrency=self.options.max_concurrency, decode_batch=self.options.decode_batch,
                                  prompt_cache_size=self.options.prompt_cache_size,
                                  prefill_budget=self.options.prefill_budget or None, **self._disk_tier()))
            for event in pipe.events(self.config.timeout, busy=lambda: bool(self._streams)):
                self._dispatch(event)
        finally:
            self._pipe = None
            pipe.stop()

    def _disk_tier(self) -> dict[str, Any]:
        """The serve message's disk tier: each rank's directory on its own host, and its size."""
        from mlxpipe.cluster.storage import prompt_cache_dir

        if self.options.prompt_cache_gb <= 0:
            return {}
        dirs = [prompt_cache_dir(h, self.options.prompt_cache_dir) for h in self.config.target.hostfile.hosts]
        return {"prompt_cache_dirs": dirs, "prompt_cache_gb": self.options.prompt_cache_gb}

    def _loaded(self, stats: RankStats) -> None:
        rank = self.ranks[stats.rank]
        rank.state, rank.peak_memory_gb, rank.memory_gb = "loaded", stats.peak_memory_gb, None

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Time):
            rank = self.ranks[event.rank]
            rank.memory_gb, rank.peak_memory_gb = event.memory, event.peak_memory
            rank.disk_cache = event.disk_cache
            self.time[rank.rank] = event.spent()
            return
        if isinstance(event, Serving):
            rank = self.ranks[event.rank]
            rank.state = "ready"
            rank.prompt_cache_dir, rank.prompt_cache_error = event.prompt_cache_dir, event.prompt_cache_error
            if all(r.state == "ready" for r in self.ranks):
                with self._lock:
                    self._set_state("ready", None)
                    while self._waiting:
                        self._send(self._waiting.popleft())
            return
        if not isinstance(event, (Token, Finished)):
            return
        stream = self._streams.get(str(event.id))
        if stream is None:
            return  # a request already ended here (cancelled, failed)
        if isinstance(event, Token):
            assert event.token is not None  # served tokens are ids, never a text's end
            self.tokens_out += 1
            stream.put(event.token if event.logprob is None else Sampled(event.token, event.logprob, event.top or []))
        else:
            with self._lock:
                self._streams.pop(stream.request.id, None)
            replayed = stream.resumed[-1].replayed if stream.resumed else 0  # counted as the reply's, not the prompt's
            stream.put(Outcome(
                finish_reason=event.finish_reason,
                prompt_tokens=event.prompt_tokens - replayed,
                cached_tokens=min(event.cached_tokens, event.prompt_tokens - replayed),
                generation_tokens=event.generation_tokens + replayed,
                error=RequestFailed(event.error) if event.error is not None else None,
                cache_tier=event.cache_tier,
            ))

    def _backoff(self) -> float:
        """The wait before relaunching after a failure: longer for each failure in a row, the row started again
        by a pipeline that was ready ``STABLE_SECONDS`` before it failed."""
        stable = self._ready_since is not None and time.monotonic() - self._ready_since >= STABLE_SECONDS
        self._in_a_row = 1 if stable else self._in_a_row + 1
        self._ready_since = None
        return _BACKOFF_SECONDS[min(self._in_a_row, len(_BACKOFF_SECONDS)) - 1]

    def _set_state(self, state: str, detail: str | None) -> None:
        self.state, self.detail = state, detail
        if state == "ready":
            self._ready_since = time.monotonic()
        else:
            for r in self.ranks:
                r.state = state
        self._on_state(state, detail)

    # --- requests --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Live requests: computing on the ranks, queued there, or waiting here for the ranks to be ready."""
        return len(self._streams)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        return self.options.max_concurrency + self.options.max_queue

    def new_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Stream:
        """Send ``request`` to the ranks, or keep it until they are ready; the caller checked ``capacity``."""
        if self.state == "failed":
            assert self.error is not None
            raise self.error
        stream = Stream(request, loop)
        with self._lock:
            self._streams[request.id] = stream
            if self.state == "ready" and self._pipe is not None:
                self._send(stream)
            else:
                self._waiting.append(stream)
        return stream

    def _send(self, stream: Stream) -> None:
        """To every rank (under the lock, so that the ranks see requests in the order they came); a resumed
        request with the reply so far after its prompt."""
        assert self._pipe is not None
        # A sampled request without a seed gets one here, kept: resumed, it goes on with the same draws.
        stream.request = stream.request.with_seed(lambda: random.randrange(2**31))
        left = stream.request.max_tokens - len(stream.sent)
        if left <= 0:  # its ranks failed after its last token, before they said it ended
            self._streams.pop(stream.request.id, None)
            stream.put(Outcome(finish_reason="length", prompt_tokens=len(stream.request.tokens or ()),
                               generation_tokens=len(stream.sent)))
            return
        self._pipe.ranks.send(Submit(stream.request.resume(stream.sent)))

    def cancel(self, request_id: str) -> None:
        """The client is gone or its stop string came: free its slot on every rank (or its place here)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and stream in self._waiting:
                self._waiting.remove(stream)
                return
        pipe = self._pipe
        if stream is not None and pipe is not None:
            pipe.ranks.send(Cancel(request_id))

    def _resume_or_fail(self, error: MlxpipeError) -> None:
        """The ranks failed with ``error``: the requests they had wait to go on once the pipeline is back (first,
        in the order they came); those resumed ``MAX_RESUMES`` times already (or all, with ``resume_timeout`` 0)
        end with ``error``."""
        now = time.monotonic()
        with self._lock:
            kept = set(map(id, self._waiting))
            running = sorted((s for s in self._streams.values() if id(s) not in kept), key=lambda s: s.submitted)
            resumed = [s for s in running if self.options.resume_timeout > 0 and len(s.resumed) < MAX_RESUMES
                       and s.request.tokens is not None]
            for stream in resumed:
                stream.resumed.append(Resumed(error.message, len(stream.sent), now))
            self._waiting.extendleft(reversed(resumed))
            ended = [s for s in running if s not in resumed]
            for stream in ended:
                self._streams.pop(stream.request.id, None)
        for stream in ended:
            stream.put(Outcome(error=error))

    def _fail_all(self, error: MlxpipeError) -> None:
        """End every request with ``error``, those waiting for the ranks too (the server stops or gives up; a
        failure of the ranks alone goes through ``_resume_or_fail``)."""
        with self._lock:
            ended = list(self._streams.values())
            self._streams = {}
            self._waiting.clear()
        for stream in ended:
            stream.put(Outcome(error=error))

    def _expire(self) -> None:
        """End the requests that waited too long for the ranks to be ready (``_late``)."""
        while not self._stopping.wait(_EXPIRY_SECONDS):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._waiting if self._late(s, now)]
                for stream in late:
                    self._waiting.remove(stream)
                    self._streams.pop(stream.request.id, None)
            for stream in late:
                if stream.resumed:
                    error = LaunchError(f"{stream.resumed[-1].cause}; the pipeline was not back within "
                                        f"{self.options.resume_timeout:g} s (--resume-timeout), still {self.state}",
                                        "check that host (the cause names it); raise --resume-timeout to wait longer")
                else:
                    error = LaunchError(f"waited {self.options.queue_timeout:g} s for the pipeline, which is still "
                                        f"{self.state}", "try again later; /health says when it is ready")
                stream.put(Outcome(error=error))

    def _late(self, stream: Stream, now: float) -> bool:
        """Whether a waiting request waited too long: a resumed one ``resume_timeout`` since the failure, a new one
        ``queue_timeout`` since it came."""
        if stream.resumed:
            return now - stream.resumed[-1].failed_at > self.options.resume_timeout
        return now - stream.submitted > self.options.queue_timeout

    def drain(self) -> None:
        """Take no new request (``serve.door.admit`` answers 503) for the ``drain_seconds`` that the ones in flight
        have to finish; the server stops once they have (``idle``) or the time is up."""
        if self.drain_ends is None:
            self.drain_ends = time.monotonic() + self.options.drain_seconds

    def wait_drained(self) -> bool:
        """Wait until no request is in flight (True) or the drain's time is up (False)."""
        assert self.drain_ends is not None
        while self.in_flight and not self._stopping.is_set():
            left = self.drain_ends - time.monotonic()
            if left <= 0:
                return False
            self._stopping.wait(min(left, _EXPIRY_SECONDS))
        return True

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": "draining" if self.drain_ends is not None and self.state != "failed" else self.state,
            "model": self.meta.source,
            "restarts": self.restarts,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "decode_batch": self.options.decode_batch,
            "ranks": [self._rank_health(r) for r in self.ranks],
        }
        if self.plan.tp > 1:  # --tp: each rank's pipeline stage and place in its stage's tensor-parallel group
            out["tp"] = self.plan.tp
            for entry, planned in zip(out["ranks"], self.plan.ranks, strict=True):
                entry.update(stage=planned.stage, tp_index=planned.tp_index)
        time = dict(self.time)
        if time:
            out["time"] = where_time_goes(time)  # since the pipeline (re)started, when a request last ended
        if self.error is not None:
            out["error"] = self.error.message
        return out

    def _rank_health(self, rank: RankState) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank.rank, "host": rank.host, "layers": list(rank.layers), "state": rank.state}
        if self.options.prompt_cache_gb > 0:  # the disk tier: its folder on the rank's host, what it keeps
            out["prompt_cache"] = {"dir": rank.prompt_cache_dir, "error": rank.prompt_cache_error,
                                   **(rank.disk_cache or {})}
        return out


RECENT_REQUESTS = 50  # the requests the page lists


# What a refused request's record holds of a generated one's: nothing was computed.
_NOTHING_COMPUTED: dict[str, Any] = {"prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0, "ttft": None,
                                     "tps": 0.0, "seconds": 0.0, "busy": []}


@dataclass
class RequestLog:
    """One line per request in the run directory's ``requests.jsonl`` (refused ones too); the last ones and the
    totals in memory."""

    path: Path | None = None
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    requests: int = 0
    refused: int = 0  # requests answered with an error before anything was generated
    cache_hits: int = 0  # requests whose prompt began with tokens a kept KV cache held
    cached_tokens: int = 0
    prompt_tokens: int = 0
    # Per tier of the prompt cache ("memory", "disk"): its hits, and the tokens they gave.
    tier_hits: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})
    tier_tokens: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.requests += 1
            cached = record.get("cached_tokens", 0)
            self.cache_hits += cached > 0
            self.cached_tokens += cached
            self.prompt_tokens += record.get("prompt_tokens", 0)
            tier = record.get("cache_tier")
            if cached > 0 and tier in self.tier_hits:
                self.tier_hits[tier] += 1
                self.tier_tokens[tier] += cached
            self._append(record)

    def refuse(self, record: dict[str, Any]) -> None:
        """A refused request's record (``door.refused``): listed with the others, counted apart."""
        with self._lock:
            self.refused += 1
            self._append({**_NOTHING_COMPUTED, **record})

    def _append(self, record: dict[str, Any]) -> None:
        self.recent.append(record)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def figures(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The recent requests, newest first, and the totals since the server started (``tiers``: per tier of
        the prompt cache, its hits and the tokens they gave)."""
        with self._lock:
            tiers = {t: {"hits": self.tier_hits[t], "cached_tokens": self.tier_tokens[t]} for t in self.tier_hits}
            return list(self.recent)[::-1], {"requests": self.requests, "refused": self.refused,
                                             "hits": self.cache_hits, "cached_tokens": self.cached_tokens,
                                             "prompt_tokens": self.prompt_tokens, "tiers": tiers}
