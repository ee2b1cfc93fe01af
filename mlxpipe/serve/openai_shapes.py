"""OpenAI's response shapes: ``chat.completion`` and ``text_completion`` bodies, their server-sent-event chunks
(ending with ``data: [DONE]``), usage, and errors as ``{"error": {"message", "type", "param", "code"}}``.

Only shapes: what goes in them is read from a ``serve.generation.Generation`` by the door (``openai_api``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from mlxpipe.serve.door import ApiError
from mlxpipe.serve.generation import Generation
from mlxpipe.serve.stream import Sampled
from mlxpipe.serve.text import Delta

DONE = "data: [DONE]\n\n"


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` in OpenAI's error shape."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def error_response(error: ApiError) -> JSONResponse:
    """``error`` as a response in OpenAI's error shape, with its status and headers."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def usage(generation: Generation) -> dict[str, Any]:
    """The ``usage`` object: prompt, completion and cached tokens."""
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}


def _piece(decode: Callable[[int], str], token: int, logprob: float) -> dict[str, Any]:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[Sampled], decode: Callable[[int], str]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: one entry per token, its ``top_logprobs`` best first."""
    content = [{**_piece(decode, e.token, e.logprob),
                "top_logprobs": [_piece(decode, int(t), lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Sampled], decode: Callable[[int], str], offset: int) -> dict[str, Any]:
    """A text completion's legacy ``logprobs``; ``offset``: where the first token's text starts in the reply."""
    tokens = [decode(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(int(t)): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


@dataclass(frozen=True)
class Shapes:
    """One reply's bodies: a chat completion or a text completion, whole or in chunks."""

    id: str
    created: int
    model: str
    chat: bool

    def whole(self, text: str, reasoning: str, calls: list[dict[str, Any]] | None, finish_reason: str,
              usage: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The reply in one body; ``calls``: its tool calls, parsed (None: the model wrote none); ``logprobs``:
        the choice's, when asked for."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls is not None:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self.head(False), "choices": [choice], "usage": usage}

    def opening(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant's role."""
        return self.chunk({"role": "assistant", "content": ""})

    def delta(self, delta: Delta, calls: list[dict[str, Any]]) -> Any:
        """What ``delta`` adds, as a chunk's ``delta`` (chat) or ``text``; ``calls``: its tool calls, parsed."""
        if not self.chat:
            return delta.text
        out: dict[str, Any] = {}
        if delta.text:
            out["content"] = delta.text
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            out["tool_calls"] = calls
        return out

    def closing(self, finish_reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The chunk that ends the choice."""
        return self.chunk({} if self.chat else "", finish_reason, logprobs)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk, with usage (``stream_options.include_usage``)."""
        return {**self.head(True), "choices": [], "usage": usage}

    def chunk(self, delta: Any, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One chunk of the stream; ``logprobs``: its tokens', when asked for."""
        if self.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self.head(True), "choices": [choice]}

    def head(self, streaming: bool) -> dict[str, Any]:
        """The fields every body and chunk starts with."""
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
