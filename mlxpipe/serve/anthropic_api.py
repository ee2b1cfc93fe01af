"""The Anthropic door of ``mlxpipe serve``: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Streaming with Anthropic's event sequence, or one ``message`` body (``anthropic_shapes``), so the ``anthropic``
package and Claude-style agents work unchanged; the key comes as ``x-api-key`` (or ``Authorization: Bearer``);
every error is in Anthropic's error shape, naming the field at fault (``anthropic_schemas`` checks every field
before anything reaches a rank). Tool calls the model writes come back as ``tool_use`` blocks, parsed with
mlx-lm's tool parser as the OpenAI door parses them. A query string (Claude Code's ``?beta=true``) and Anthropic's
headers (``anthropic-version``, ``anthropic-beta``) change nothing here. Every refusal is said by ``door.refused``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxpipe.errors import RequestFailed
from mlxpipe.serve import anthropic_shapes as shapes
from mlxpipe.serve.anthropic_schemas import Parsed, parse
from mlxpipe.serve.door import ApiError, ClientGone, ServerSettings, authorize, gone, read_json, refused
from mlxpipe.serve.generation import Generation, respond, start
from mlxpipe.serve.image_urls import fetch_image_urls
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.text import Delta, tool_calls

DOOR = "anthropic"  # this door's name in the server's output and request log

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class AnthropicApi:
    """The Anthropic Messages endpoints over the request queue."""

    def __init__(
        self, queue: RequestQueue, tokenizer: TokenizerWrapper, settings: ServerSettings, log: RequestLog
    ) -> None:
        self.queue, self.tokenizer, self.settings, self.log = queue, tokenizer, settings, log

    def routes(self) -> list[Route]:
        """This door's routes."""
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens through the chat template, as ``messages`` would count them (nothing generated)."""
        try:
            authorize(request, self.settings.api_key)
            body = await fetch_image_urls(await read_json(request, self.settings.max_body_bytes), self.settings)
            parsed = parse(body, self.settings, self.tokenizer, self.queue.new_id, counting=True)
        except ApiError as e:
            return shapes.error_response(refused(self.log, request, DOOR, e))
        except ClientDisconnect:
            return gone(request)
        tokens = parsed.request.tokens
        assert tokens is not None  # parse tokenizes the prompt
        return JSONResponse({"input_tokens": len(tokens)})

    async def messages(self, request: Request) -> Response:
        try:
            authorize(request, self.settings.api_key)
            body = await fetch_image_urls(await read_json(request, self.settings.max_body_bytes), self.settings)
            parsed = parse(body, self.settings, self.tokenizer, self.queue.new_id)
            generation = await start(self.queue, self.tokenizer, self.log, request, parsed.request, parsed.stops,
                                     DOOR, parsed.notes)
        except ApiError as e:
            return shapes.error_response(refused(self.log, request, DOOR, e))
        except (ClientDisconnect, ClientGone):
            return gone(request)
        return await respond(generation, _Run(self, parsed, generation), request, parsed.stream)


class _Run:
    """One request's reply in Anthropic's shapes (``generation.ReplyShapes``)."""

    def __init__(self, api: AnthropicApi, parsed: Parsed, generation: Generation) -> None:
        self.api, self.parsed, self.generation = api, parsed, generation
        self.message = shapes.Message(f"msg_{uuid.uuid4().hex[:24]}", parsed.model or api.settings.model_id,
                                      generation.prompt_tokens)

    def _calls(self, texts: list[str]) -> list[dict[str, Any]]:
        if not texts:
            return []
        try:
            return tool_calls(self.api.tokenizer, texts, self.parsed.tools, False)
        except Exception as e:  # noqa: BLE001 - the model wrote a tool call its parser cannot read
            raise RequestFailed(f"the model's tool call could not be parsed: {type(e).__name__}: {e}") from None

    def opening(self) -> list[str]:
        return self.message.opening()

    def add(self, delta: Delta) -> list[str]:
        return self.message.add(delta, self._calls(delta.tool_calls))

    def closing(self) -> list[str]:
        return self.message.closing(self.generation)

    def failed(self, error: ApiError) -> str:
        return shapes.event(shapes.error_body(error))

    def body(self) -> dict[str, Any]:
        return self.message.body(self.generation)

    def error_response(self, error: ApiError) -> Response:
        return shapes.error_response(error)
