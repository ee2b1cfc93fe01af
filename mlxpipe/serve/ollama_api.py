"""The Ollama door of ``mlxpipe serve``: ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``, ``GET /api/ps``,
``POST /api/show``, ``GET /api/version``, for the desktop apps and tools that speak only Ollama's API.

Replies stream as newline-delimited JSON (Ollama's default, ``"stream": true``) or come in one object; the last
one has ``done``, ``done_reason`` (``stop`` / ``length``) and the counts (``prompt_eval_count``, ``eval_count``)
with durations in nanoseconds. Tool calls the model writes come back as the message's ``tool_calls``, parsed with
mlx-lm's tool parser. Errors are Ollama's ``{"error": "..."}``, naming the field.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxpipe.errors import RequestFailed
from mlxpipe.serve.door import ApiError, ClientGone, ServerSettings, authorize, gone, read_json, refused
from mlxpipe.serve.generation import Generation, respond, start
from mlxpipe.serve.ollama_schemas import Parsed, check_model, parse
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.text import Delta, tool_calls

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

NDJSON = "application/x-ndjson"
DOOR = "ollama"  # this door's name in the server's output and request log

OLLAMA_VERSION = "0.6.0"  # the API version these shapes follow, for the clients that ask
_KEPT = "2999-01-01T00:00:00Z"  # /api/ps's expiry of a model the server keeps loaded until it stops


def error_response(error: ApiError) -> JSONResponse:
    """``error`` in Ollama's shape: one message (the field named in it)."""
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaApi:
    """Ollama's endpoints over the request queue."""

    def __init__(
        self, queue: RequestQueue, tokenizer: TokenizerWrapper, settings: ServerSettings, log: RequestLog
    ) -> None:
        self.queue, self.tokenizer, self.settings, self.log = queue, tokenizer, settings, log

    def routes(self) -> list[Route]:
        """This door's routes."""
        return [Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/version", self.version, methods=["GET"])]

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(self, request: Request) -> Response:
        try:
            authorize(request, self.settings.api_key)
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        return JSONResponse({"models": [{"name": name, "model": name, "modified_at": _now(), "size": 0,
                                         "digest": "", "details": self._details()}
                                        for name in self.settings.model_names]})

    async def ps(self, request: Request) -> Response:
        """The models loaded: this one under each name, kept loaded while the server runs (no expiry)."""
        try:
            authorize(request, self.settings.api_key)
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        return JSONResponse({"models": [{"name": name, "model": name, "size": 0, "digest": "",
                                         "details": self._details(), "expires_at": _KEPT, "size_vram": 0,
                                         "context_length": self.settings.context}
                                        for name in self.settings.model_names]})

    async def show(self, request: Request) -> Response:
        try:
            authorize(request, self.settings.api_key)
            check_model(await read_json(request, self.settings.max_body_bytes), self.settings)
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        except ClientDisconnect:
            return gone(request)
        capabilities = ["completion"] + (["tools"] if getattr(self.tokenizer, "has_tool_calling", False) else [])
        return JSONResponse({"modelfile": "", "parameters": "", "template": self.tokenizer.chat_template or "",
                             "details": self._details(), "model_info": {"context_length": self.settings.context},
                             "capabilities": capabilities, "modified_at": _now()})

    def _details(self) -> dict[str, Any]:
        return {"format": "mlx", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}

    async def chat(self, request: Request) -> Response:
        return await self._reply(request, chat=True)

    async def generate(self, request: Request) -> Response:
        return await self._reply(request, chat=False)

    async def _reply(self, request: Request, chat: bool) -> Response:
        try:
            authorize(request, self.settings.api_key)
            body = await read_json(request, self.settings.max_body_bytes)
            if not chat and not body.get("prompt") and not body.get("images"):
                # An empty prompt loads the model in Ollama; here it is loaded already.
                return JSONResponse({"model": check_model(body, self.settings), "created_at": _now(), "response": "",
                                     "done": True, "done_reason": "load"})
            parsed = parse(body, chat, self.settings, self.tokenizer, self.queue.new_id)
            generation = await start(self.queue, self.tokenizer, self.log, request, parsed.request, parsed.stops,
                                     DOOR, parsed.notes)
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        except (ClientDisconnect, ClientGone):
            return gone(request)
        return await respond(generation, _Run(self, parsed, generation, chat), request, parsed.stream, NDJSON,
                             headers=None)


class _Run:
    """One request's reply in Ollama's shapes: newline-delimited JSON or one object (``generation.ReplyShapes``)."""

    def __init__(self, api: OllamaApi, parsed: Parsed, generation: Generation, chat: bool) -> None:
        self.api, self.parsed, self.generation, self.chat = api, parsed, generation, chat
        self.started = time.monotonic_ns()
        # The reply in one object, as it grows.
        self._texts: list[str] = []
        self._reasonings: list[str] = []
        self._tool_calls: list[dict[str, Any]] = []

    def _calls(self, texts: list[str]) -> list[dict[str, Any]]:
        if not texts or not self.chat:
            return []
        try:
            parsed = tool_calls(self.api.tokenizer, texts, self.parsed.tools, False)
        except Exception as e:  # noqa: BLE001 - the model wrote a tool call its parser cannot read
            raise RequestFailed(f"the model's tool call could not be parsed: {type(e).__name__}: {e}") from None
        return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in parsed]

    def _piece(self, delta: Delta, calls: list[dict[str, Any]]) -> dict[str, Any]:
        head = {"model": self.parsed.model, "created_at": _now()}
        if not self.chat:
            return {**head, "response": delta.text, **({"thinking": delta.reasoning} if delta.reasoning else {}),
                    "done": False}
        message: dict[str, Any] = {"role": "assistant", "content": delta.text}
        if delta.reasoning:
            message["thinking"] = delta.reasoning
        if calls:
            message["tool_calls"] = calls
        return {**head, "message": message, "done": False}

    def _last(self, piece: dict[str, Any]) -> dict[str, Any]:
        """The last object: done, why, and the counts."""
        g = self.generation
        elapsed = time.monotonic_ns() - self.started
        first = g.stream.first_token or g.stream.submitted
        prefill = int((first - g.stream.submitted) * 1e9)
        return {**piece, "done": True, "done_reason": "length" if g.finish_reason == "length" else "stop",
                "total_duration": elapsed + prefill, "load_duration": 0, "prompt_eval_count": g.prompt_tokens,
                "prompt_eval_duration": prefill, "eval_count": g.completion_tokens, "eval_duration": elapsed}

    def opening(self) -> list[str]:
        return []

    def add(self, delta: Delta) -> list[str]:
        """A line of ``delta`` when streamed, else ``delta`` into the one object."""
        calls = self._calls(delta.tool_calls)
        if self.parsed.stream:
            return [json.dumps(self._piece(delta, calls)) + "\n"]
        self._texts.append(delta.text)
        self._reasonings.append(delta.reasoning)
        self._tool_calls.extend(calls)
        return []

    def closing(self) -> list[str]:
        return [json.dumps(self._last(self._piece(Delta(), []))) + "\n"]

    def failed(self, error: ApiError) -> str:
        return json.dumps({"error": error.message}) + "\n"

    def body(self) -> dict[str, Any]:
        return self._last(self._piece(Delta("".join(self._texts), "".join(self._reasonings)), self._tool_calls))

    def error_response(self, error: ApiError) -> Response:
        return error_response(error)
