"""OpenAI Responses' shapes: the ``response`` object, its output items (``message``, ``function_call``,
``reasoning``), usage, and its streaming events (``response.created``, ``response.output_item.added``,
``response.output_text.delta`` ... ``response.completed``), each with its ``sequence_number``. Errors take
OpenAI's shape (``openai_shapes.error_response``).

Only shapes: what goes in them is read from a ``serve.generation.Generation`` by the door (``responses_api``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlxpipe.serve.door import ApiError
from mlxpipe.serve.generation import Generation
from mlxpipe.serve.text import Delta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(generation: Generation) -> dict[str, Any]:
    """The ``usage`` object: input tokens (of which cached), output tokens."""
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": generation.cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def error_event(error: ApiError) -> dict[str, Any]:
    """A stream's last event when the reply fails after it began."""
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


def function_call(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call (``serve.text.tool_calls``, OpenAI's chat shape) as a ``function_call`` item."""
    function = call["function"]
    call_id = call.get("id") or _id("call")
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id if call_id.startswith("call") else
            f"call_{call_id}", "name": function["name"], "arguments": function.get("arguments") or "{}",
            "status": "completed"}


@dataclass
class Reply:
    """One response: its output items as they grow, the events that say so, the response object."""

    id: str
    created: int
    model: str
    echo: dict[str, Any]
    output: list[dict[str, Any]] = field(default_factory=list)
    _open: str | None = None  # the type of the item being streamed
    _sequence: int = 0

    def body(self, status: str, generation: Generation | None = None) -> dict[str, Any]:
        """The response object: ``in_progress`` (no usage yet), ``completed`` or ``incomplete``."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [dict(i) for i in self.output], "error": None,
                "incomplete_details": incomplete, "usage": usage(generation) if generation else None,
                **self.echo}

    def add(self, delta: Delta, calls: list[dict[str, Any]]) -> list[str]:
        """``delta`` (``calls``: its tool calls, parsed) into the output; returns its events."""
        out = []
        if delta.reasoning:
            out += self._extend("reasoning", delta.reasoning)
        if delta.text:
            out += self._extend("message", delta.text)
        for call in calls:
            out += self._close()
            item = function_call(call)
            self.output.append(item)
            index = len(self.output) - 1
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"], name=item["name"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def opening(self) -> list[str]:
        body = self.body("in_progress")
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def closing(self, status: str, generation: Generation) -> list[str]:
        """The last item's end, then ``response.completed`` (or ``response.incomplete``)."""
        return self._close() + [self.event(f"response.{status}", response=self.body(status, generation))]

    def finish(self) -> None:
        """The items' ends, for a reply answered in one body."""
        self._close()

    def event(self, kind: str, **data: Any) -> str:
        """One server-sent event, numbered."""
        body = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _extend(self, kind: str, text: str) -> list[str]:
        out = []
        if self._open != kind:
            out += self._close()
            self._open = kind
            if kind == "message":
                item: dict[str, Any] = {"type": "message", "id": _id("msg"), "status": "in_progress",
                                        "role": "assistant", "content": []}
            else:
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
            part_kind = "output_text" if kind == "message" else "reasoning_text"
            part: dict[str, Any] = {"type": part_kind, "text": ""}
            if kind == "message":
                part.update(annotations=[], logprobs=[])
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0, part=dict(part)))
            item["content"] = [part]
        item = self.output[-1]
        item["content"][0]["text"] += text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(kind_event, item_id=item["id"], output_index=len(self.output) - 1, content_index=0,
                              delta=text, **extra))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        item, index = self.output[-1], len(self.output) - 1
        part = item["content"][0]
        out = []
        if kind == "message":
            item["status"] = "completed"
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part))]
        else:
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"]))
        out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return out
