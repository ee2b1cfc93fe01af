"""``mlxpipe serve``: the pipeline kept up behind the HTTP APIs (OpenAI's, Anthropic's, Ollama's).

``queue`` keeps the pipeline up and carries every request to the ranks and its tokens back (launch, requests,
restarts), ``app`` is the HTTP app (its doors: ``openai_api``, ``anthropic_api``, ``responses_api``,
``ollama_api``), ``text`` turns tokens into what a client sees. ``serve()`` ties them to uvicorn: it plans,
checks and downloads once (errors end the command before anything listens), then listens while the ranks load,
and serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import uvicorn

from mlxpipe import console
from mlxpipe.defaults import DEFAULT_MAX_BODY_BYTES
from mlxpipe.errors import LaunchError, UsageError
from mlxpipe.launch.config import PipelineConfig
from mlxpipe.launch.run import prepare
from mlxpipe.protocol.request import Request
from mlxpipe.serve.queue import RequestLog, RequestQueue, ServeOptions
from mlxpipe.vision.images import ImageLimits

if TYPE_CHECKING:
    from pathlib import Path
    from types import FrameType

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.vision.prompt import VisionPrompt

__all__ = ["ServeOptions", "serve"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(config: PipelineConfig, options: ServeOptions, *, host: str, port: int, api_key: str | None,
          defaults: Request, context: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          served_names: tuple[str, ...] = (), any_model_name: bool = False,
          image_limits: ImageLimits = ImageLimits(),  # noqa: B008 - frozen, one shared default is safe
          image_url_timeout: float | None = None) -> int:
    """Serve until a signal (returns 128 + its number) or until the pipeline cannot be restarted (raises).

    ``defaults``: every request's options until its body says otherwise; ``context``: the longest prompt and
    reply a request may make (default: the model's ``max_position_embeddings``); ``served_names``: more names
    the model answers to; ``any_model_name``: it answers to every name; ``image_limits``: what each image a
    request sends may be; ``image_url_timeout``: seconds to fetch an image URL a request sends (None: URLs are
    refused).
    """
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.serve.door import ServerSettings

    _check(options, host, port, api_key, max_body_bytes)
    if any(not name.strip() for name in served_names):
        raise UsageError("--served-model-name: a name may not be empty")
    meta, plan = prepare(config)
    vision_missing = _vision_missing(meta)
    log = RequestLog()
    server: _Server | None = None

    def on_state(state: str, detail: str | None) -> None:
        if state == "ready":
            log.path = queue.run_dir / "requests.jsonl" if queue.run_dir else None
            console.err.print(f"[green]ready[/]: {len(plan.ranks)} ranks loaded; logs: {queue.run_dir}")
            if queue.restarts == 0:  # once: a relaunch changes nothing there
                _say_disk_tier(queue)
                console.err.print(f"the cluster's page: http://{_url_host(host)}:{port}/ (open it in a browser)")
        elif state == "restarting":
            console.warn(f"a rank failed ({detail}); relaunching the pipeline (restart {queue.restarts} "
                         f"of {options.max_restarts})")
        elif state == "failed" and server is not None:
            server.should_exit = True  # a failure before the server exists is read once it does, below

    queue = RequestQueue(replace(config, quiet=True), meta, plan, options, on_state)
    settings = ServerSettings(
        model_id=config.target.model, api_key=api_key, context=context or _context(meta), defaults=defaults,
        vocab_size=meta.text_config.get("vocab_size"), max_body_bytes=max_body_bytes,
        draft_model=config.draft_model is not None, served_names=served_names, any_model_name=any_model_name,
        vision=None, vision_missing=vision_missing, image_limits=image_limits, image_url_timeout=image_url_timeout,
    )
    names = ", ".join(repr(n) for n in settings.model_names) + (", or any name" if any_model_name else "")
    console.err.print(f"serving {config.target.model} at http://{_url_host(host)}:{port}/v1 "
                      f"(model id {names}); loading {len(plan.ranks)} ranks...")
    if vision_missing:
        from mlxpipe.vision.prompt import VISION_HINT

        console.warn(f"a vision-language model, served as text only: this install lacks mlx-vlm "
                     f"(for images: {VISION_HINT})")
    queue.start()  # the ranks load while this process loads the tokenizer, the image processor and the app
    try:
        from mlxpipe.serve.app import build_app

        tokenizer = _load_tokenizer(controller_model_dir(meta), meta.config)
        settings = replace(settings, vision=_vision_prompt(config, meta))
        app = build_app(queue, tokenizer, settings, log)
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=3), queue)
    except BaseException:
        queue.stop()
        raise
    if queue.state == "failed":  # before the server existed to be told
        server.should_exit = True
    _quiet_lost_connections()
    try:
        server.run()
    finally:
        queue.stop()
    if server.signal is not None:
        console.error(f"stopped by {server.signal_name}")
        return 128 + server.signal
    if queue.error is not None:
        failures = queue.restarts + 1
        raise LaunchError(f"the pipeline failed {failures} time{'s' if failures > 1 else ''}, the last time: "
                          f"{queue.error.message}", queue.error.hint)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server that, on SIGTERM, drains: it takes no new request and gives the ones in flight
    ``--drain-seconds`` to finish; on SIGINT (Ctrl-C), or a second SIGTERM, it ends the queues' requests at once.
    It does not re-raise the signal. A fleet's server (``serve.fleet_server``) has one queue per pipeline: each
    drains, and it stops once every one has drained or the time is up."""

    def __init__(self, config: uvicorn.Config, *queues: RequestQueue) -> None:
        super().__init__(config)
        self.queues = queues  # a fleet's: one per pipeline
        self.signal: int | None = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    @property
    def drain_seconds(self) -> float:
        """The longest drain of the queues (a fleet's share ``--drain-seconds``)."""
        return max(q.options.drain_seconds for q in self.queues)

    @property
    def in_flight(self) -> int:
        return sum(q.in_flight for q in self.queues)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.signal is None and self.drain_seconds > 0:
            self.signal = sig
            for queue in self.queues:
                queue.drain()
            console.warn(f"SIGTERM: finishing the {self.in_flight} requests in flight, for at most "
                         f"{self.drain_seconds:g} s (--drain-seconds), and taking no new ones; "
                         "SIGTERM again or Ctrl-C stops now")
            threading.Thread(target=self._drain, daemon=True, name="mlxpipe-drain").start()
            return
        if self.signal is None:
            self.signal = sig
        self._stop()

    def _drain(self) -> None:
        # Every queue in turn: each waits for its own requests, up to the one deadline they were all given.
        drained = [queue.wait_drained() for queue in self.queues]
        if all(drained):
            console.err.print("drained: every request in flight finished")
        else:
            console.warn(f"drained for {self.drain_seconds:g} s (--drain-seconds): the "
                         f"{self.in_flight} requests still in flight end now")
        self._stop()

    def _stop(self) -> None:
        # End the streams now: uvicorn's graceful shutdown waits for them.
        for queue in self.queues:
            threading.Thread(target=queue.stop, daemon=True).start()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in original.items():
                signal.signal(s, handler)

    def run(self, sockets: Any = None) -> None:
        super().run(sockets)
        if not self.started and self.signal is None:
            raise UsageError("the HTTP server could not start (see above)", "pick another --port or --host")


def _say_disk_tier(queue: RequestQueue) -> None:
    """Where each rank keeps the prompt cache on disk, and which rank could not (then no rank hits)."""
    if queue.options.prompt_cache_gb <= 0:
        return
    for r in queue.ranks:
        if r.prompt_cache_error is not None:
            console.warn(f"rank {r.rank} ({r.host}) has no prompt cache on disk ({r.prompt_cache_error}); "
                         "no request is served from the disk tier")
    folders = sorted({r.prompt_cache_dir for r in queue.ranks if r.prompt_cache_dir is not None})
    if folders:
        console.err.print(f"prompt cache on disk: up to {queue.options.prompt_cache_gb:g} GB per rank, in "
                          + ", ".join(folders))


def _vision_prompt(config: PipelineConfig, meta: ModelMetadata) -> VisionPrompt | None:
    """The processor that tokenizes requests with images, where the ranks run the model with mlx-vlm."""
    from mlxpipe.launch.config import vision_job
    from mlxpipe.launch.pipeline import controller_model_dir

    if not vision_job(meta.config, config.mode, False, config.draft_model is not None):
        return None
    from mlxpipe.vision.prompt import VisionPrompt

    return VisionPrompt(controller_model_dir(meta), meta.config)


def _vision_missing(meta: ModelMetadata) -> bool:
    """A vision-language model that this install cannot give images to: mlx-vlm (the vision extra) is missing."""
    from mlxpipe.vision.prompt import is_vision_config, vision_installed

    return is_vision_config(meta.config) and not vision_installed()


def _check(options: ServeOptions, host: str, port: int, api_key: str | None, max_body_bytes: int) -> None:
    if options.max_concurrency < 1:
        raise UsageError(f"--max-concurrency must be at least 1, got {options.max_concurrency}")
    if options.max_queue < 0 or options.max_restarts < 0 or options.prompt_cache_size < 0:
        raise UsageError("--max-queue, --max-restarts and --prompt-cache-size must be 0 or more")
    if not options.prompt_cache_gb >= 0:
        raise UsageError(f"--prompt-cache-gb must be 0 (no disk tier) or more, got {options.prompt_cache_gb:g}")
    if not options.queue_timeout > 0:
        raise UsageError(f"--queue-timeout must be positive, got {options.queue_timeout:g}")
    if options.prefill_budget < 0:
        raise UsageError(f"--prefill-budget must be 0 (no bound) or more, got {options.prefill_budget}")
    if not options.resume_timeout >= 0:
        raise UsageError(f"--resume-timeout must be 0 (a rank's failure ends the requests in flight) or more, "
                         f"got {options.resume_timeout:g}")
    if not options.drain_seconds >= 0:
        raise UsageError(f"--drain-seconds must be 0 (SIGTERM stops at once) or more, got {options.drain_seconds:g}")
    if max_body_bytes < 1024:
        raise UsageError(f"--max-body-size must be at least 1024 bytes, got {max_body_bytes}")
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: expected a TCP port, 1-65535")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key (or MLXPIPE_API_KEY) is empty")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})",
                         "pick another --port, or stop what uses it") from None
    if host not in _LOOPBACK and api_key is None:
        console.warn(f"listening on {host} without --api-key: anyone who reaches this machine can use the model")


class _LostConnectionFilter(logging.Filter):
    """asyncio's note for each write to a connection its client already closed (a dropped stream): not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "socket.send() raised exception."


def _quiet_lost_connections() -> None:
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _LostConnectionFilter) for f in logger.filters):
        logger.addFilter(_LostConnectionFilter())


def _load_tokenizer(model_dir: Path, config: dict[str, Any]) -> TokenizerWrapper:
    from mlx_lm.utils import load_tokenizer

    tokenizer: TokenizerWrapper = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    return tokenizer


def _context(meta: ModelMetadata) -> int:
    n = meta.text_config.get("max_position_embeddings") or meta.config.get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else 1 << 20


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
