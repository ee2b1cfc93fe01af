"""The HTTP app of ``mlxpipe serve`` (Starlette): every API door's routes, ``GET /health``, the
cluster's page (``cluster_view``), unknown routes.

Each door is a module of its own that turns one HTTP dialect into requests for the queue and the replies back
(``openai_api``: OpenAI's chat completions and completions; ``anthropic_api``: Anthropic's Messages;
``responses_api``: OpenAI's Responses; ``ollama_api``: Ollama's); what every door shares (the API key, the
body-size limit, admission, failures, clients that go away, the line each refusal makes) is ``door``. No body
can break the server: a door checks every field before anything reaches a rank, and a failure of one request ends
that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mlxpipe.serve.anthropic_api import AnthropicApi
from mlxpipe.serve.cluster_view import ClusterView, page_routes
from mlxpipe.serve.door import ApiError, ServerSettings, refused
from mlxpipe.serve.ollama_api import OllamaApi
from mlxpipe.serve.openai_api import OpenAIApi
from mlxpipe.serve.openai_shapes import error_response
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.responses_api import ResponsesApi

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class _Door(Protocol):
    """What the app reads of an API door: its routes."""

    def routes(self) -> list[Route]: ...


def build_app(queue: RequestQueue, tokenizer: TokenizerWrapper, settings: ServerSettings, log: RequestLog,
              first: Sequence[BaseRoute] = ()) -> Starlette:
    """The Starlette app serving ``queue``; ``first``: routes matched before its own (a fleet's router's, which
    send each request to its model's pipeline: ``serve.router``)."""

    async def health(request: Request) -> Response:
        body = queue.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    # Outside every door, errors take OpenAI's shape: the dialect every client of this server speaks.
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(404, f"no route {request.method} {request.url.path}", code="not_found")
        return error_response(refused(log, request, "http", error))

    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(405, f"{request.method} is not allowed on {request.url.path}")
        return error_response(refused(log, request, "http", error))

    # A bug in the server (no door's refusal): one line and a record as well, so that a client's failure is never
    # silent; Starlette still logs the traceback after this answer.
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(500, f"the server failed: {type(exc).__name__}: {exc}", code="internal_error",
                         kind="server_error")
        return error_response(refused(log, request, "http", error))

    doors: list[_Door] = [OpenAIApi(queue, tokenizer, settings, log), AnthropicApi(queue, tokenizer, settings, log),
             ResponsesApi(queue, tokenizer, settings, log), OllamaApi(queue, tokenizer, settings, log)]
    routes: list[BaseRoute] = [*first, Route("/health", health, methods=["GET"]),
                               *(r for door in doors for r in door.routes())]
    limits = settings.image_limits
    images = None if settings.vision is None else {"max_bytes": limits.max_bytes, "max_images": limits.max_images}
    view = ClusterView(queue, log, settings.model_id, images)  # the cluster's page at /
    view.start()
    routes += page_routes(view, settings.api_key)
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, Exception: failed})
