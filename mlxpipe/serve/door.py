"""What every API door of ``mlxpipe serve`` shares: the server's settings, the gate, errors, clients that leave.

A door (``openai_api``, ``anthropic_api``, ``responses_api``, ``ollama_api``) turns one HTTP dialect into
``mlxpipe.protocol.request.Request`` and the reply back into that dialect's shapes; everything here is the same whatever
the dialect: the API key (as a bearer token or ``x-api-key``), the body-size limit, the room for one more request
(admission), the names the model answers to, how a failure maps to a status, and a client that goes away. Errors
are ``ApiError``: a status and the field at fault, with no shape of their own; each door writes them in its own,
and says each one it answers with ``refused``: one line in the server's output and one in the request log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from mlxpipe import console
from mlxpipe.defaults import DEFAULT_MAX_BODY_BYTES
from mlxpipe.errors import RequestFailed
from mlxpipe.protocol.request import Request as GenerationRequest
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.vision.images import ImageLimits

if TYPE_CHECKING:
    from mlxpipe.vision.prompt import VisionPrompt

T = TypeVar("T")

# A body over the limit is read to its end (and dropped) so that the client reads the 413, up to this many times
# the limit; beyond, the connection is closed.
_DRAIN_FACTOR = 16
# How often a request answered in one body checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.5
# Where a fleet's router (``serve.router``) leaves the body it read to find the model, for the door it picks.
ROUTED_BODY = "mlxpipe.routed_body"


@dataclass(frozen=True)
class ServerSettings:
    """What every door reads of the server's command line."""

    model_id: str
    api_key: str | None
    context: int  # the longest prompt + completion the model takes (--context, else the model's own)
    # The server's flags; a body overrides its options. Frozen, so one shared default is safe (RUF009).
    defaults: GenerationRequest = GenerationRequest()  # noqa: RUF009
    vocab_size: int | None = None  # the model's: logit_bias may name no token beyond it
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    draft_model: bool = False  # speculative decoding (--draft-model): some options are refused (bodies.for_ranks)
    # A vision-language model's processor (images in: ``bodies.with_images``); None: the model takes no images.
    vision: VisionPrompt | None = None
    # A vision-language model served without mlx-vlm (the vision extra): its images are refused naming the extra.
    vision_missing: bool = False
    image_limits: ImageLimits = ImageLimits()  # noqa: RUF009 - frozen, one shared default is safe
    # --allow-image-urls: seconds an image URL may take to fetch (serve.image_urls); None: URLs are refused.
    image_url_timeout: float | None = None
    served_names: tuple[str, ...] = ()  # --served-model-name: more names the model answers to, listed with it
    any_model_name: bool = False  # --any-model-name: every name a body gives is this model
    # The names seen under --any-model-name, each said once in the server's output.
    _seen: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    _seen_lock: threading.Lock = field(default_factory=threading.Lock, init=False, compare=False, repr=False)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names ``/v1/models`` (and Ollama's tags) list: ``--model``'s value, then its aliases."""
        return (self.model_id, *(n for n in self.served_names if n != self.model_id))

    def answers_to(self, name: str) -> bool:
        """This server serves ``name``: one of ``model_names``, or any name under ``--any-model-name`` (a name
        seen for the first time is one line in the server's output: which clients call it what)."""
        if name in self.model_names:
            return True
        if not self.any_model_name:
            return False
        with self._seen_lock:
            new = name not in self._seen and len(self._seen) < _MAX_NAMES_SAID
            self._seen.add(name)
        if new:
            console.note(f"model name {name!r} answered by {self.model_id} (--any-model-name)")
        return True


_MAX_NAMES_SAID = 256  # a client that makes up a name per request cannot fill the log


class ClientGone(Exception):
    """The client went away before its reply was ready (answered with ``gone``)."""


class ApiError(Exception):
    """An error response: its status, the field at fault (``param``) and a machine-readable ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}
        self.logged = False  # its request's line is written already (a request that failed at its first token)


class ContextTooLong(ApiError):
    """A prompt the context cannot hold: both counts, in the words agents know how to act on (OpenAI's here;
    the Anthropic door writes Anthropic's, ``prompt is too long: N tokens > M maximum``)."""

    def __init__(self, prompt_tokens: int, context: int, param: str) -> None:
        super().__init__(400, f"This model's maximum context length is {context} tokens. However, your messages "
                              f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                         param=param, code="context_length_exceeded")
        self.prompt_tokens, self.context = prompt_tokens, context


def refused(log: RequestLog, http: Request, door: str, error: ApiError) -> ApiError:
    """``error``, answered by ``door`` before any reply began, said once: one line in the server's output (door,
    status, field, reason) and a record in the request log, so that the person running the server sees why a
    client failed. Returns ``error`` for the door to answer with."""
    if error.logged:
        return error
    error.logged = True
    at = f" '{error.param}'" if error.param else ""
    console.note(f"refused {http.method} {http.url.path} ({door}): {error.status}{at}: {error.message[:300]}",
                 style="yellow")
    log.refuse({"id": None, "door": door, "method": http.method, "path": http.url.path, "status": str(error.status),
                "param": error.param, "code": error.code, "error": error.message, "time": time.time()})
    return error


def authorize(request: Request, api_key: str | None) -> None:
    """Nothing without ``--api-key``; else the request must bring it as ``Authorization: Bearer <key>`` (OpenAI's
    clients) or ``x-api-key: <key>`` (Anthropic's), whatever the door."""
    if api_key is None:
        return
    bearer = request.headers.get("authorization", "")
    header = request.headers.get("x-api-key", "")
    # Both compared, always: the time taken says nothing about which header was close.
    by_bearer = hmac.compare_digest(bearer.encode(), f"Bearer {api_key}".encode())
    by_header = hmac.compare_digest(header.encode(), api_key.encode())
    if not (by_bearer or by_header):
        raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key> or x-api-key: <key>",
                       code="invalid_api_key", kind="authentication_error")


def admit(queue: RequestQueue) -> None:
    """Room for one more request (it waits here while the ranks load or relaunch), else 429; none while the server
    drains (SIGTERM), 503 until it has stopped."""
    if queue.drain_ends is not None:
        retry = max(1, math.ceil(queue.drain_ends - time.monotonic()))
        raise ApiError(503, "the server is shutting down (SIGTERM): it finishes the requests in flight and takes "
                            "no new ones; try again once it is back", code="shutting_down", kind="server_error",
                       headers={"Retry-After": str(retry)})
    if queue.in_flight >= queue.capacity:
        raise ApiError(429, f"{queue.in_flight} requests in flight, the most this server takes "
                            f"(--max-concurrency + --max-queue); try again shortly",
                       code="rate_limit_exceeded", kind="rate_limit_error", headers={"Retry-After": "1"})


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; over ``limit`` bytes, a 413 (the body read to its end first, up to a point, so
    that the client, still sending, reads the answer instead of a reset connection)."""
    routed: dict[str, Any] | None = request.scope.get(ROUTED_BODY)
    if routed is not None:  # read (and checked) once already, by the router that picked this door's pipeline
        return routed
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    raw = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received <= limit and (declared is None or declared <= limit):
            raw += chunk
        elif received > _DRAIN_FACTOR * limit:
            break  # too much to read only to refuse it: the connection closes
    if received > limit or (declared is not None and declared > limit):
        raise ApiError(413, f"the body has {declared or received} bytes, over this server's limit of {limit} "
                            "(--max-body-size)", code="request_too_large",
                       headers={"Connection": "close"} if received > _DRAIN_FACTOR * limit else None)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity (Python's reader takes them)."""
    raise ValueError(f"{name} is not a JSON value")


async def until(item: Awaitable[T], request: Request) -> T:
    """``item``, or ``ClientGone`` when the client goes away first (checked every ``DISCONNECT_POLL_SECONDS``)."""
    task = asyncio.ensure_future(item)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
    return task.result()


def gone(request: Request) -> Response:
    """The client went away: nobody reads the answer (nginx's 499), and one line says so."""
    console.err.print(f"[dim]{request.method} {request.url.path}: the client went away[/]")
    return Response(status_code=499)


def failure(error: Exception) -> ApiError:
    """A request that failed alone (500), or whose pipeline failed or never came up (503)."""
    message = getattr(error, "message", str(error))
    hint = getattr(error, "hint", None)
    text = f"{message} ({hint})" if hint else message
    if isinstance(error, RequestFailed):
        return ApiError(500, text, code="request_failed", kind="server_error")
    return ApiError(503, text, code="pipeline_failed", kind="server_error", headers={"Retry-After": "5"})
