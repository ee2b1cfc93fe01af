"""Anthropic's response shapes: the ``message`` body, its streaming events (``message_start``, ``ping``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``), usage and errors as
``{"type": "error", "error": {"type", "message"}}``.

Only shapes: what goes in them is read from a ``serve.generation.Generation`` by the door (``anthropic_api``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from mlxpipe.serve.door import ApiError, ContextTooLong
from mlxpipe.serve.generation import Generation
from mlxpipe.serve.text import Delta

# Anthropic's error types by status (its API answers 529 where this server says 503: overloaded, retry).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` in Anthropic's error shape; the field at fault is named in the message, its only place there."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message
    if isinstance(error, ContextTooLong):  # Anthropic's own words, which Claude Code acts on (it compacts)
        message = f"prompt is too long: {error.prompt_tokens} tokens > {error.context} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: ApiError) -> JSONResponse:
    """``error`` as a response in Anthropic's shape, with its status and headers."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def event(data: dict[str, Any]) -> str:
    """One server-sent event, named by its type as Anthropic names them."""
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


def usage(generation: Generation) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are those not read from the prompt cache."""
    cached = generation.cached_tokens
    return {"input_tokens": generation.prompt_tokens - cached, "output_tokens": generation.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(generation: Generation, used_tools: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: ``stop_sequence`` (which), ``max_tokens``, ``tool_use``, ``end_turn``."""
    if generation.stop_string is not None:
        return "stop_sequence", generation.stop_string
    if generation.finish_reason == "length":
        return "max_tokens", None
    return ("tool_use" if used_tools else "end_turn"), None


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call (``serve.text.tool_calls``, OpenAI's shape) as a ``tool_use`` block."""
    function = call["function"]
    arguments = json.loads(function["arguments"]) if function.get("arguments") else {}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": function["name"],
            "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


@dataclass
class Message:
    """One reply: the ``message`` body, or its events as the reply's deltas arrive."""

    id: str
    model: str
    prompt_tokens: int
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: str | None = None  # the type of the block being streamed

    def body(self, generation: Generation) -> dict[str, Any]:
        """The whole message, once the reply has ended."""
        reason, sequence = stop_reason(generation, any(b["type"] == "tool_use" for b in self.blocks))
        content = self.blocks or [{"type": "text", "text": ""}]
        return {**self._head(content), "stop_reason": reason, "stop_sequence": sequence, "usage": usage(generation)}

    def add(self, delta: Delta, calls: list[dict[str, Any]]) -> list[str]:
        """``delta`` (``calls``: its tool calls, parsed) into the blocks; returns its events."""
        out = []
        if delta.reasoning:
            out += self._extend("thinking", "thinking_delta", "thinking", delta.reasoning)
        if delta.text:
            out += self._extend("text", "text_delta", "text", delta.text)
        for call in calls:
            out += self._close()
            block = tool_use(call)
            self.blocks.append(block)
            index = len(self.blocks) - 1
            out += [event({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}}),
                    event({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}),
                    event({"type": "content_block_stop", "index": index})]
        return out

    def opening(self) -> list[str]:
        """``message_start`` (its usage counts the whole prompt: what the cache saved is known at the end) and a
        ``ping``."""
        start = {**self._head([]), "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event({"type": "message_start", "message": start}), event({"type": "ping"})]

    def closing(self, generation: Generation) -> list[str]:
        """The last block's stop, ``message_delta`` (stop reason, final usage) and ``message_stop``."""
        out = self._close()
        if not self.blocks:  # an empty reply still has its one (empty) text block
            out += self._extend("text", "text_delta", "text", "") + self._close()
        reason, sequence = stop_reason(generation, any(b["type"] == "tool_use" for b in self.blocks))
        out.append(event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": usage(generation)}))
        out.append(event({"type": "message_stop"}))
        return out

    def _extend(self, kind: str, delta_kind: str, key: str, text: str) -> list[str]:
        out = []
        if self._open != kind:
            out += self._close()
            block = {"type": kind, key: ""} if kind == "text" else {"type": kind, key: "", "signature": ""}
            self.blocks.append(block)
            self._open = kind
            out.append(event({"type": "content_block_start", "index": len(self.blocks) - 1,
                              "content_block": dict(block)}))
        self.blocks[-1][key] += text
        if text:
            out.append(event({"type": "content_block_delta", "index": len(self.blocks) - 1,
                              "delta": {"type": delta_kind, key: text}}))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event({"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _head(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}
