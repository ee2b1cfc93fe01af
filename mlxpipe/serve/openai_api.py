"""The OpenAI door of ``mlxpipe serve``: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

Streaming as server-sent events ending with ``data: [DONE]``, or one JSON body. Shapes follow OpenAI's
(``openai_shapes``), so the ``openai`` package and any OpenAI client work unchanged; every error is a 4xx/5xx in
OpenAI's error shape naming the field at fault (``openai_schemas`` checks every field before anything reaches a
rank). A response starts only once its first token (or its error) is there (``generation.start``), so a request
that waited for the ranks to load and gave up still gets a plain 503. A client that goes away, at any moment,
costs one line in the log.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxpipe.errors import RequestFailed
from mlxpipe.serve import openai_shapes as shapes
from mlxpipe.serve.door import ApiError, ClientGone, ServerSettings, authorize, gone, read_json, refused
from mlxpipe.serve.generation import Generation, respond, start
from mlxpipe.serve.image_urls import fetch_image_urls
from mlxpipe.serve.openai_schemas import Parsed, parse
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.text import Delta, tool_calls

DOOR = "openai"  # this door's name in the server's output and request log

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class OpenAIApi:
    """The OpenAI endpoints over the request queue."""

    def __init__(
        self, queue: RequestQueue, tokenizer: TokenizerWrapper, settings: ServerSettings, log: RequestLog
    ) -> None:
        self.queue, self.tokenizer, self.settings, self.log = queue, tokenizer, settings, log
        # A token's own text, for logprobs (the same few thousand tokens come back again and again).
        self.decode = lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))

    def routes(self) -> list[Route]:
        """This door's routes."""
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    async def models(self, request: Request) -> Response:
        """The model, under each name it answers to (``--model``'s value, then ``--served-model-name``'s)."""
        try:
            authorize(request, self.settings.api_key)
        except ApiError as e:
            return shapes.error_response(refused(self.log, request, DOOR, e))
        models = [{"id": name, "object": "model", "created": 0, "owned_by": "mlxpipe",
                   "max_model_len": self.settings.context} for name in self.settings.model_names]
        return JSONResponse({"object": "list", "data": models})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            authorize(request, self.settings.api_key)
            body = await fetch_image_urls(await read_json(request, self.settings.max_body_bytes), self.settings)
            parsed = parse(body, chat, self.settings, self.tokenizer, self.queue.new_id)
            generation = await start(self.queue, self.tokenizer, self.log, request, parsed.request, parsed.stops,
                                     DOOR, parsed.notes)
        except ApiError as e:
            return shapes.error_response(refused(self.log, request, DOOR, e))
        except (ClientDisconnect, ClientGone):
            return gone(request)
        return await respond(generation, _Run(self, parsed, generation, chat), request, parsed.stream)


class _Run:
    """One request's reply in OpenAI's shapes: SSE chunks or one body (``generation.ReplyShapes``)."""

    def __init__(self, api: OpenAIApi, parsed: Parsed, generation: Generation, chat: bool) -> None:
        self.api, self.parsed, self.generation, self.chat = api, parsed, generation, chat
        self.shapes = shapes.Shapes(("chatcmpl-" if chat else "cmpl-") + parsed.request.id, int(time.time()),
                                    parsed.model or api.settings.model_id, chat)
        self._text_offset = 0  # the legacy completions' text_offset of the next token
        # The reply in one body, as it grows: its text, its reasoning, its tool calls (None: the model wrote none).
        self._text, self._reasoning = "", ""
        self._calls: list[dict[str, Any]] | None = None

    def _logprobs(self) -> dict[str, Any] | None:
        """The logprobs of the tokens since the last call, in this API's shape (None: not asked for)."""
        if not self.parsed.request.logprobs:
            return None
        entries = self.generation.take_logprobs()
        decode = self.api.decode
        if self.chat:
            return shapes.chat_logprobs(entries, decode)
        body = shapes.completion_logprobs(entries, decode, self._text_offset)
        self._text_offset += sum(len(t) for t in body["tokens"])
        return body

    def _tool_calls(self, texts: list[str]) -> list[dict[str, Any]]:
        try:
            return tool_calls(self.api.tokenizer, texts, self.parsed.tools, self.parsed.stream)
        except Exception as e:  # noqa: BLE001 - the model wrote a tool call its parser cannot read
            raise RequestFailed(f"the model's tool call could not be parsed: {type(e).__name__}: {e}") from None

    def opening(self) -> list[str]:
        """A chat stream's first chunk: the assistant's role."""
        return [shapes.sse(self.shapes.opening())] if self.chat else []

    def add(self, delta: Delta) -> list[str]:
        """A stream's chunk of ``delta`` (its tokens' logprobs with it), or ``delta`` into the one body."""
        calls = self._tool_calls(delta.tool_calls) if self.chat and delta.tool_calls else []
        if self.parsed.stream:
            return [shapes.sse(self.shapes.chunk(self.shapes.delta(delta, calls), logprobs=self._logprobs()))]
        self._text, self._reasoning = self._text + delta.text, self._reasoning + delta.reasoning
        if self.chat and delta.tool_calls:
            self._calls = (self._calls or []) + calls
        return []

    def closing(self) -> list[str]:
        """The chunk that ends the choice (with the logprobs of tokens that showed no text of their own yet), the
        usage chunk when asked for, ``[DONE]``."""
        leftover = self._logprobs()
        lines = [shapes.sse(self.shapes.closing(self.generation.finish_reason,
                                                leftover if leftover and (leftover.get("content") or
                                                                          leftover.get("tokens")) else None))]
        if self.parsed.include_usage:
            lines.append(shapes.sse(self.shapes.usage_chunk(shapes.usage(self.generation))))
        return [*lines, shapes.DONE]

    def failed(self, error: ApiError) -> str:
        return shapes.sse(shapes.error_body(error))

    def body(self) -> dict[str, Any]:
        return self.shapes.whole(self._text, self._reasoning, self._calls, self.generation.finish_reason,
                                 shapes.usage(self.generation), self._logprobs())

    def error_response(self, error: ApiError) -> Response:
        return shapes.error_response(error)
