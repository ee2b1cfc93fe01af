"""``mlxpipe serve --fleet``: every pipeline of a fleet kept up behind one endpoint (``serve.router``).

As ``server.serve`` does for one pipeline: every pipeline is planned, checked and downloaded first (errors end the
command before anything listens), the hosts shared by entries are checked against everything they hold together,
then the endpoint listens while every pipeline loads, each in its own ``RequestQueue``. A pipeline that fails past
its restarts answers its requests with a 503 while the others serve; the server ends when every pipeline has
failed, or on SIGINT or SIGTERM. SIGTERM drains, as a single serve's does (``server._Server``): every pipeline
takes no new request (a 503 with Retry-After) while the ones in flight on any of them finish, for up to
``--drain-seconds``; then every pipeline stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import uvicorn

from mlxpipe import console
from mlxpipe.errors import LaunchError, PlanError
from mlxpipe.fleet.plan import Placed, shortfalls
from mlxpipe.fleet.spec import FleetEntry
from mlxpipe.launch.config import PipelineConfig
from mlxpipe.launch.run import prepare
from mlxpipe.protocol.request import Request
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog, RequestQueue, ServeOptions
from mlxpipe.serve.router import Router, Served
from mlxpipe.serve.server import (
    _check,
    _context,
    _load_tokenizer,
    _quiet_lost_connections,
    _Server,
    _url_host,
    _vision_missing,
    _vision_prompt,
)
from mlxpipe.vision.images import ImageLimits

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxpipe.cluster.hostfile import Hostfile
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.plan.shard import Plan


@dataclass(frozen=True)
class FleetPipeline:
    """One pipeline of the fleet: an entry's replica, its launch config and its queue's options."""

    entry: FleetEntry
    replica: int
    config: PipelineConfig
    options: ServeOptions

    @property
    def label(self) -> str:
        return self.entry.replica_label(self.replica)


@dataclass(frozen=True)
class Endpoint:
    """What the whole endpoint shares, from the command line."""

    host: str
    port: int
    api_key: str | None
    defaults: Request
    max_body_bytes: int
    any_model_name: bool = False
    image_limits: ImageLimits = ImageLimits()  # noqa: RUF009 - frozen, one shared default is safe
    image_url_timeout: float | None = None


def serve_fleet(pipelines: Sequence[FleetPipeline], hostfile: Hostfile, endpoint: Endpoint) -> int:
    """Serve until a signal (returns 128 + its number) or until every pipeline has failed (raises)."""
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.serve.app import build_app

    for p in pipelines:
        _check(p.options, endpoint.host, endpoint.port, endpoint.api_key, endpoint.max_body_bytes)
    prepared = [(p, *prepare(p.config)) for p in pipelines]
    _require_together(prepared, hostfile)
    states = _States(endpoint)
    tokenizers: dict[int, TokenizerWrapper] = {}
    served: dict[int, list[Served]] = {}
    for p, meta, plan in prepared:
        if p.entry.index not in tokenizers:
            tokenizers[p.entry.index] = _load_tokenizer(controller_model_dir(meta), meta.config)
        one = _served(p, meta, plan, tokenizers[p.entry.index], endpoint, first=not served, states=states)
        served.setdefault(p.entry.index, []).append(one)
        states.served.append(one)
    router = Router(list(served.values()), endpoint.any_model_name)
    first = router.first
    app = build_app(first.queue, first.tokenizer, first.settings, first.log, first=router.routes())
    server = states.server = _Server(uvicorn.Config(app, host=endpoint.host, port=endpoint.port, log_level="warning",
                                                    lifespan="off", timeout_graceful_shutdown=3),
                                     *(s.queue for s in router.served))
    _say_serving(router, endpoint)
    for s in router.served:
        s.queue.start()
    _quiet_lost_connections()
    try:
        server.run()
    finally:
        for s in router.served:
            s.queue.stop()
    if server.signal is not None:
        console.error(f"stopped by {server.signal_name}")
        return 128 + server.signal
    failed = [s for s in router.served if s.queue.error is not None]
    if failed:
        error = failed[0].queue.error
        assert error is not None
        raise LaunchError(f"every pipeline failed; {failed[0].label}'s last failure: {error.message}", error.hint)
    return 0


def _served(p: FleetPipeline, meta: ModelMetadata, plan: Plan, tokenizer: TokenizerWrapper, endpoint: Endpoint, *,
            first: bool, states: _States) -> Served:
    """One pipeline's queue (not started), its settings and its request log."""
    log = RequestLog()
    queue = RequestQueue(replace(p.config, quiet=True), meta, plan, p.options,
                         lambda state, detail: states.on_state(queue, log, state, detail))
    queue.label = p.label
    settings = ServerSettings(
        model_id=p.config.target.model, api_key=endpoint.api_key, context=p.config.context or _context(meta),
        defaults=endpoint.defaults, vocab_size=meta.text_config.get("vocab_size"),
        max_body_bytes=endpoint.max_body_bytes, draft_model=p.config.draft_model is not None,
        served_names=p.entry.names, any_model_name=endpoint.any_model_name and first,
        vision=_vision_prompt(p.config, meta), vision_missing=_vision_missing(meta),
        image_limits=endpoint.image_limits, image_url_timeout=endpoint.image_url_timeout,
    )
    return Served(p.label, queue, tokenizer, settings, log)


class _States:
    """What every queue's state callback reports to (made before the queues; the server is set once it is made)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.served: list[Served] = []
        self.server: _Server | None = None

    def on_state(self, queue: RequestQueue, log: RequestLog, state: str, detail: str | None) -> None:
        if state == "ready":
            log.path = queue.run_dir / "requests.jsonl" if queue.run_dir else None
            console.err.print(f"[green]ready[/]: {queue.label}: {_ranks(len(queue.ranks))} loaded; "
                              f"logs: {queue.run_dir}")
            if queue.restarts == 0 and all(s.queue.state == "ready" for s in self.served):
                where = f"http://{_url_host(self.endpoint.host)}:{self.endpoint.port}/"
                console.err.print(f"every model is ready; the cluster's page: {where} (open it in a browser)")
        elif state == "restarting":
            console.warn(f"{queue.label}: a rank failed ({detail}); relaunching its pipeline (restart "
                         f"{queue.restarts} of {queue.options.max_restarts})")
        elif state == "failed":
            console.warn(f"{queue.label}: its pipeline failed for good ({detail}); its requests get a 503")
            if self.server is not None and all(s.queue.state == "failed" for s in self.served):
                self.server.should_exit = True


def _require_together(prepared: Sequence[tuple[FleetPipeline, ModelMetadata, Plan]], hostfile: Hostfile) -> None:
    """Refuse, before anything starts, a host that cannot hold what the entries sharing it give it together."""
    placed = [Placed(p.entry, p.replica, p.entry.groups()[p.replica], plan) for p, _, plan in prepared]
    short = shortfalls(placed, hostfile)
    if short:
        s = short[0]
        raise PlanError(f"host {s.host} ({s.ssh}) lacks {console.human_bytes(s.lacks_bytes)} to hold "
                        f"{' and '.join(s.holders)} together", "see `mlxpipe plan --fleet`: move an entry to other "
                                                               "hosts, or give it a shorter 'context'")


def _say_serving(router: Router, endpoint: Endpoint) -> None:
    url = f"http://{_url_host(endpoint.host)}:{endpoint.port}/v1"
    console.err.print(f"serving {len(router.entries)} models at {url}; loading every pipeline...")
    for entry in router.entries:
        names = ", ".join(repr(n) for n in entry[0].settings.model_names)
        ranks = " + ".join(_ranks(len(s.queue.ranks)) for s in entry)  # one pipeline per replica
        console.err.print(f"  {entry[0].settings.model_id}: model id {names}; {ranks}"
                          + (", or any name" if entry[0].settings.any_model_name else ""))


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n > 1 else ''}"
