"""The cluster's page of ``mlxpipe serve``: ``GET /`` (the page), ``/page/*`` (its script and styles), and
``GET /v1/cluster``, the JSON it draws.

The page is static files shipped in the package (``serve/page/``): no build step, nothing fetched from
elsewhere. It asks ``/v1/cluster`` every second or so for what it shows: each rank (``/health``'s ranks, with
their memory against the host's budget), the live figures (a bounded history of tok/s and requests in flight,
sampled here every ``SAMPLE_SECONDS`` by a thread, so that a page opened late still draws the last minutes),
where each rank's time goes, the prompt cache's hits and the recent requests (refused ones too, with why).
``/v1/cluster`` is behind the API key like the API (the page asks for the key); the page and its files hold no
data and are open.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from mlxpipe.serve.door import ApiError, authorize, refused
from mlxpipe.serve.openai_shapes import error_response
from mlxpipe.serve.queue import RequestLog, RequestQueue

PAGE_DIR = Path(__file__).parent / "page"
SAMPLE_SECONDS = 1.0
HISTORY_SAMPLES = 300  # five minutes of samples


class History:
    """A ring buffer of the server's figures: tok/s and requests in flight, one sample per ``sample`` call."""

    def __init__(self, size: int = HISTORY_SAMPLES) -> None:
        self.samples: deque[dict[str, float]] = deque(maxlen=size)
        self._last: tuple[float, int] | None = None  # (time, tokens) at the last sample

    def sample(self, now: float, tokens: int, in_flight: int) -> None:
        """One sample at ``now`` (seconds since the epoch): the tokens since the last one, per second."""
        if self._last is None or tokens < self._last[1]:
            rate = 0.0
        else:
            rate = (tokens - self._last[1]) / max(now - self._last[0], 1e-6)
        self._last = (now, tokens)
        self.samples.append({"t": round(now, 3), "tps": round(rate, 2), "in_flight": in_flight})


class ClusterView:
    """What the page shows, from the queue, the plan and the request log."""

    def __init__(self, queue: RequestQueue, log: RequestLog, model_id: str,
                 images: dict[str, int] | None = None) -> None:
        self.queue, self.log, self.model_id = queue, log, model_id
        self.images = images  # the image limits, where the model takes images: the page's chat offers to attach
        self.history = History()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Sample the figures every ``SAMPLE_SECONDS`` until the queue has ended (stopped, or gave up)."""
        threading.Thread(target=self._sample_until_finished, daemon=True, name="mlxpipe-page-figures").start()

    def _sample_until_finished(self) -> None:
        while not self.queue.finished.wait(SAMPLE_SECONDS):
            self.sample()

    def sample(self) -> None:
        """One sample of the live figures."""
        with self._lock:
            self.history.sample(time.time(), self.queue.tokens_out, self.queue.in_flight)

    def snapshot(self) -> dict[str, Any]:
        """The page's data: ``/health``'s body, each rank's memory and time, the figures and recent requests."""
        health = self.queue.health()
        times = {t["rank"]: t for t in health.get("time", {}).get("ranks", [])}
        with self._lock:
            history = list(self.history.samples)
        requests, cache = self.log.figures()
        return {
            **health,
            "model_id": self.model_id,
            "images": self.images,
            "detail": self.queue.detail,
            # /health's ranks as they are (a tensor-parallel group or stage it names included), with figures.
            "ranks": [self._rank(r, times.get(r["rank"])) for r in health["ranks"]],
            "hops": [_hop(h, times.get(h["to"])) for h in health.get("time", {}).get("hops", [])],
            "history": {"interval_s": SAMPLE_SECONDS, "samples": history},
            "cache": cache,
            "requests": requests,
        }

    def _rank(self, rank: dict[str, Any], time_spent: dict[str, Any] | None) -> dict[str, Any]:
        # Looked up by number, not position: /health may come to name ranks the plan's list does not order so.
        state = next((r for r in self.queue.ranks if r.rank == rank["rank"]), None)
        planned = next((r for r in self.queue.plan.ranks if r.rank == rank["rank"]), None)
        budget = planned.budget_bytes if planned is not None else None
        return {
            **rank,
            "peak_memory_gb": state.peak_memory_gb if state is not None else None,
            "memory_gb": state.memory_gb if state is not None else None,
            "budget_gb": budget / 1e9 if budget else None,
            "busy": time_spent["busy"] if time_spent else None,
        }


def _hop(hop: dict[str, Any], into: dict[str, Any] | None) -> dict[str, Any]:
    """A hop's wait, with its share of the receiving rank's working time (computing, sending or waiting)."""
    if into is None:
        return hop
    working = sum(into[k] for k in ("compute_s", "send_s", "recv_s", "sync_s"))
    return {**hop, "wait_share": hop["wait_s"] / working if working > 0 else 0.0}


def page_routes(view: ClusterView, api_key: str | None) -> list[BaseRoute]:
    """``/``, ``/page/*`` and ``/v1/cluster``."""

    async def index(request: Request) -> Response:
        return FileResponse(PAGE_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def cluster(request: Request) -> Response:
        try:
            authorize(request, api_key)
        except ApiError as e:
            return error_response(refused(view.log, request, "page", e))
        return JSONResponse(view.snapshot(), headers={"Cache-Control": "no-store"})

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)  # browsers ask for one with every page: not a refusal worth a line

    return [
        Route("/", index, methods=["GET"]),
        Route("/favicon.ico", no_icon, methods=["GET"]),
        Route("/v1/cluster", cluster, methods=["GET"]),
        Mount("/page", StaticFiles(directory=PAGE_DIR), name="page"),
    ]
