"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as a typed ``mlxpipe.request.Request``.

Every field is checked before anything reaches a rank, and every error names the body's own field
(``'temperature'``, ``'max_completion_tokens'``, ``'messages[2].content'``). The options a body may set, and
their JSON types, come from ``Request`` itself: a body field is a ``Request`` field under OpenAI's name (or
mlx_lm.server's, which is ``Request``'s own); only which fields a body may set is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from mlxpipe.errors import UsageError
from mlxpipe.prompts import prompt_tokens
from mlxpipe.request import Request, RequestError, parse_logit_bias
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import HINTS, check_schema, field, json_types
from mlxpipe.serve.door import ApiError, ServerSettings


# The Request fields a body may set, in the order they are checked; the rest (the KV cache, the prompt's
# template switches...) are the server's flags alone.
_BODY_FIELDS = ("max_tokens", "temp", "top_p", "min_p", "top_k", "xtc_probability", "xtc_threshold", "seed",
                "logit_bias", "repetition_penalty", "repetition_context_size", "presence_penalty",
                "presence_context_size", "frequency_penalty", "frequency_context_size", "chat_template_config",
                "num_draft_tokens")
# OpenAI's names where they differ from Request's.
_OPENAI_NAMES = {"temp": "temperature", "chat_template_config": "chat_template_kwargs"}


@dataclass
class Parsed:
    """A validated request body."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    include_usage: bool
    stops: list[str]
    tools: list[Any] | None


def parse(body: dict[str, Any], chat: bool, settings: ServerSettings, tokenizer: Any,
          new_id: Callable[[], str]) -> Parsed:
    """``body`` checked and turned into a request for the ranks (its prompt as token ids); raises ``ApiError``."""
    model = body.get("model")
    if model is not None and model != settings.model_id:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {settings.model_id!r}",
                       param="model", code="model_not_found")
    n = field(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {n}", param="n")
    request = _options(body, settings, chat)
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, None) or {}
    include_usage = bool(options.get("include_usage", False))
    stops = bodies.stops(body, "stop")
    tools = field(body, "tools", list, None) if chat else None
    if tools is not None and len(tools) > bodies.MAX_TOOLS:
        raise ApiError(400, f"'tools' takes at most {bodies.MAX_TOOLS} tools, got {len(tools)}", param="tools")
    tokens = _tokens(body, chat, tools, request, tokenizer)
    if len(tokens) + 1 > settings.context:
        param = "messages" if chat else "prompt"
        raise ApiError(400, f"'{param}' makes a prompt of {len(tokens)} tokens; this server's context is "
                            f"{settings.context} tokens", param=param, code="context_length_exceeded")
    max_tokens = min(request.max_tokens, settings.context - len(tokens))
    ranked = replace(request, id=new_id(), tokens=tokens, max_tokens=max_tokens)
    return Parsed(ranked, stream, include_usage, stops, tools)


# Body field -> (Request field, JSON types).
_BODY_OPTIONS: dict[str, tuple[str, Any]] = {
    _OPENAI_NAMES.get(key, key): (key, json_types(HINTS[key])) for key in _BODY_FIELDS
}


def _options(body: dict[str, Any], settings: ServerSettings, chat: bool) -> Request:
    """The body's options over the server's defaults, checked; errors name the body's field."""
    values: dict[str, Any] = _logprobs(body, chat)
    response_format = field(body, "response_format", dict, None)
    if response_format is not None:
        values["response_format"] = response_format
    for name, (key, kinds) in _BODY_OPTIONS.items():
        value = field(body, name, kinds, None)
        if value is not None:
            values[key] = value
    max_tokens = field(body, "max_completion_tokens", _BODY_OPTIONS["max_tokens"][1], None)
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    names = {key: name for name, (key, _) in _BODY_OPTIONS.items()}
    if max_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    if not chat:
        names["top_logprobs"] = "logprobs"  # the legacy completions' logprobs: how many top tokens
    try:
        if "logit_bias" in values:
            values["logit_bias"] = parse_logit_bias(values["logit_bias"], "'logit_bias'")
        request = replace(settings.defaults, **values).check(lambda key: f"'{names.get(key, key)}'",
                                                             settings.vocab_size)
    except RequestError as e:
        raise ApiError(400, e.message, param=names.get(e.field, e.field)) from None
    if request.response_format is not None:
        check_schema(request.response_format, "response_format")
    return request


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, with ``logprobs``); the legacy
    completions' ``logprobs``: how many top tokens to list (0 too: only the chosen token's)."""
    if not chat:
        top = field(body, "logprobs", int, None)
        return {} if top is None else {"logprobs": True, "top_logprobs": top}
    wanted = field(body, "logprobs", bool, False)
    top = field(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top or 0} if wanted else {}


def _tokens(body: dict[str, Any], chat: bool, tools: list[Any] | None, options: Request,
            tokenizer: Any) -> list[int]:
    if chat:
        messages = field(body, "messages", list, None)
        if not messages:
            raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
        request = replace(options, messages=[_message(m, i) for i, m in enumerate(messages)])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        request = replace(options, prompt=prompt, ignore_chat_template=True)
    try:
        tokens = prompt_tokens(tokenizer, request, tools)
    except UsageError as e:
        raise ApiError(400, e.message, param="messages" if chat else "prompt") from None
    except Exception as e:  # noqa: BLE001 - a chat template that rejects these messages
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if not tokens:
        raise ApiError(400, "the prompt has no tokens", param="messages" if chat else "prompt")
    return tokens


def _message(m: Any, i: int) -> dict[str, Any]:
    """A chat message for the template: string content, or the text of its parts."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'role'", param=where)
    content = m.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, f"'{where}.content' may hold only text parts", param=f"{where}.content")
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
    return {**m, "content": content if content is not None else ""}
