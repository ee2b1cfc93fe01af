"""The OpenAI Responses door of ``mlxpipe serve``: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Streaming with the Responses API's events, or one ``response`` object (``responses_shapes``), so the ``openai``
package's ``client.responses`` works unchanged; errors in OpenAI's error shape naming the field
(``responses_schemas``). Tool calls the model writes come back as ``function_call`` items, parsed with mlx-lm's
tool parser as the chat door parses them. A completed response is kept (``store``, true by default) in a
bounded in-memory store (``responses_store``: the last 256, at most 256 MiB, each for an hour) for
``previous_response_id``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxpipe.errors import RequestFailed
from mlxpipe.serve import responses_shapes as shapes
from mlxpipe.serve.door import ApiError, ClientGone, ServerSettings, authorize, gone, read_json, refused
from mlxpipe.serve.generation import Generation, respond, start
from mlxpipe.serve.image_urls import fetch_image_urls
from mlxpipe.serve.openai_shapes import error_response
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.responses_schemas import Parsed, flat_name, parse
from mlxpipe.serve.responses_store import ResponseStore
from mlxpipe.serve.text import Delta, tool_calls

DOOR = "responses"  # this door's name in the server's output and request log

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class ResponsesApi:
    """The Responses endpoints over the request queue, with their store."""

    def __init__(self, queue: RequestQueue, tokenizer: TokenizerWrapper, settings: ServerSettings, log: RequestLog,
                 store: ResponseStore | None = None) -> None:
        self.queue, self.tokenizer, self.settings, self.log = queue, tokenizer, settings, log
        self.store = store or ResponseStore()

    def routes(self) -> list[Route]:
        """This door's routes."""
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET", "DELETE"])]

    async def retrieve(self, request: Request) -> Response:
        """A stored response (``GET``), or forget it (``DELETE``)."""
        response_id = request.path_params["response_id"]
        try:
            authorize(request, self.settings.api_key)
            stored = self.store.get(response_id)
            if stored is None:
                raise ApiError(404, f"no response {response_id[:60]!r} is kept", param="response_id",
                               code="not_found", kind="invalid_request_error")
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        if request.method == "DELETE":
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        return JSONResponse(stored.body)

    async def create(self, request: Request) -> Response:
        try:
            authorize(request, self.settings.api_key)
            body = await fetch_image_urls(await read_json(request, self.settings.max_body_bytes), self.settings)
            parsed = parse(body, self.settings, self.tokenizer, self.queue.new_id, self.store)
            generation = await start(self.queue, self.tokenizer, self.log, request, parsed.request, [], DOOR,
                                     parsed.notes)
        except ApiError as e:
            return error_response(refused(self.log, request, DOOR, e))
        except (ClientDisconnect, ClientGone):
            return gone(request)
        return await respond(generation, _Run(self, parsed, generation), request, parsed.stream)


class _Run:
    """One request's reply in the Responses API's shapes (``generation.ReplyShapes``)."""

    def __init__(self, api: ResponsesApi, parsed: Parsed, generation: Generation) -> None:
        self.api, self.parsed, self.generation = api, parsed, generation
        self.reply = shapes.Reply(f"resp_{uuid.uuid4().hex}", int(time.time()),
                                  parsed.model or api.settings.model_id, parsed.echo)

    def _calls(self, texts: list[str]) -> list[dict[str, Any]]:
        """The tool calls in ``texts`` as output items, each under its tool's own name (a namespace's function
        comes back with its ``namespace``, a custom tool's call as a ``custom_tool_call``)."""
        if not texts:
            return []
        try:
            calls = tool_calls(self.api.tokenizer, texts, self.parsed.tools, False)
        except Exception as e:  # noqa: BLE001 - the model wrote a tool call its parser cannot read
            raise RequestFailed(f"the model's tool call could not be parsed: {type(e).__name__}: {e}") from None
        items = []
        for call in calls:
            origin = self.parsed.toolbox.origin(call["function"]["name"])
            items.append(shapes.function_call(call, origin.name, origin.namespace, origin.custom))
        return items

    @property
    def status(self) -> str:
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def opening(self) -> list[str]:
        return self.reply.opening()

    def add(self, delta: Delta) -> list[str]:
        return self.reply.add(delta, self._calls(delta.tool_calls))

    def closing(self) -> list[str]:
        """The last item's end and ``response.completed``; the response is kept before the client may leave."""
        closing = self.reply.closing(self.status, self.generation)
        self._keep(self.reply.body(self.status, self.generation))
        return closing

    def failed(self, error: ApiError) -> str:
        return self.reply.event("error", **shapes.error_event(error))

    def body(self) -> dict[str, Any]:
        self.reply.finish()
        body = self.reply.body(self.status, self.generation)
        self._keep(body)
        return body

    def error_response(self, error: ApiError) -> Response:
        return error_response(error)

    def _keep(self, body: dict[str, Any]) -> None:
        """The conversation so far, its reply appended as the template reads it, for ``previous_response_id``."""
        if not self.parsed.store:
            return
        text = "".join(i["content"][0]["text"] for i in self.reply.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": flat_name(i.get("namespace"), i["name"]),
                               "arguments": _loads(i["arguments"]) if "arguments" in i else {"input": i["input"]}}}
                 for i in self.reply.output if i["type"] in ("function_call", "custom_tool_call")]
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            answer["tool_calls"] = calls
        self.api.store.put(self.reply.id, [*self.parsed.conversation, answer], body)


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
