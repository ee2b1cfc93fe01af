"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as a typed
``mlxpipe.protocol.request.Request``.

Every field is checked before anything reaches a rank, and every error names the body's own field
(``'temperature'``, ``'max_completion_tokens'``, ``'messages[2].content'``). The options a body may set, and
their JSON types, come from ``Request`` itself (``bodies.options``): a body field is a ``Request`` field under
OpenAI's name (or mlx_lm.server's, which is ``Request``'s own); only which fields a body may set is listed here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.request import Image, Request
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import field
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.tool_choice import Choice, checked_names, enforce, functions

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Body field -> Request field, in the order they are checked; the rest (the KV cache, the prompt's template
# switches...) are the server's flags alone. OpenAI's names where they differ from Request's, mlx_lm.server's
# (Request's own) for the rest; max_completion_tokens, when given, wins over max_tokens.
_OPTIONS = {"response_format": "response_format", "max_tokens": "max_tokens", "temperature": "temp",
            "top_p": "top_p", "min_p": "min_p", "top_k": "top_k", "xtc_probability": "xtc_probability",
            "xtc_threshold": "xtc_threshold", "seed": "seed", "logit_bias": "logit_bias",
            "repetition_penalty": "repetition_penalty", "repetition_context_size": "repetition_context_size",
            "presence_penalty": "presence_penalty", "presence_context_size": "presence_context_size",
            "frequency_penalty": "frequency_penalty", "frequency_context_size": "frequency_context_size",
            "chat_template_kwargs": "chat_template_config", "num_draft_tokens": "num_draft_tokens",
            "max_completion_tokens": "max_tokens"}
# Chat's logprobs (true or false) and top_logprobs (0 to 20, with logprobs); the legacy completions' logprobs:
# how many top tokens to list (0 too: only the chosen token's).
_CHAT_LOGPROBS = {"logprobs": "logprobs", "top_logprobs": "top_logprobs"}
_COMPLETION_LOGPROBS = {"logprobs": "top_logprobs"}


@dataclass
class Parsed:
    """A validated request body."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    include_usage: bool
    stops: list[str]
    tools: list[Any] | None
    model: str = ""  # the name the body gave the model, echoed back
    notes: bodies.Notes = dc_field(default_factory=list)  # what was dropped or mapped


def parse(body: dict[str, Any], chat: bool, settings: ServerSettings, tokenizer: TokenizerWrapper,
          new_id: Callable[[], str]) -> Parsed:
    """``body`` checked and turned into a request for the ranks (its prompt as token ids); raises ``ApiError``.

    ``developer`` messages are system turns; ``reasoning_effort`` is the template's thinking switch; tools of other
    types than ``function`` and ``web_search_options`` are left out (said in the notes); ``user``,
    ``service_tier``, ``store``, ``metadata``, ``prompt_cache_key`` change nothing here; ``tool_choice``,
    ``parallel_tool_calls`` and a function's ``strict`` are enforced by the grammar engine (``serve.tool_choice``);
    an earlier call's ``arguments`` reach the template as an object. ``image_url`` parts go to a vision-language
    model's processor with all of these (``bodies.tokens_and_images``).
    """
    model = bodies.check_model(body, settings)
    n = field(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {n}", param="n")
    notes: bodies.Notes = []
    request = _options(body, settings, chat)
    if chat:
        request = bodies.thinking(request, body, _thinking(body, notes))
    stream = field(body, "stream", bool, False)
    include_usage = bool((field(body, "stream_options", dict) or {}).get("include_usage", False))
    stops = bodies.stops(body, "stop")
    tools = _tools(body, notes) if chat else None
    choice = _tool_choice(body, tools) if chat else Choice()
    offered = tools if choice.mode != "none" else None
    value = choice.template_value()
    extra = {"tool_choice": value} if offered and value is not None else None
    param = "messages" if chat else "prompt"
    images: list[tuple[Image, str]] = []
    prompt = _prompt(body, chat, request, settings, images)
    tokens, pictures, vision_prompt = bodies.tokens_and_images(tokenizer, prompt, images, offered, extra, param,
                                                               settings, notes)
    request = replace(request, images=pictures, vision_prompt=vision_prompt)
    ranked = enforce(bodies.for_ranks(request, tokens, settings, param, new_id, notes=notes), offered, choice,
                     field(body, "parallel_tool_calls", bool, True), _strict(offered), tokenizer, settings)
    return Parsed(ranked, stream, include_usage, stops, offered, model, notes)


def _thinking(body: dict[str, Any], notes: bodies.Notes) -> bool | None:
    return bodies.effort_switch(field(body, "reasoning_effort", str), "reasoning_effort", notes)


def _tools(body: dict[str, Any], notes: bodies.Notes) -> list[Any] | None:
    """OpenAI's function tools are the chat template's own shape: they reach it as sent; others are left out."""
    others: list[str] = []

    def keep(tool: Any, where: str) -> list[Any]:
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind == "function":
            return [tool]
        others.append(str(kind)[:40])
        return []

    tools = bodies.tool_list(body, keep)
    if field(body, "web_search_options", dict) is not None:
        others.append("web_search_options")
    if others:
        notes.append(f"tools left out (this server runs only the model's function calls): "
                     f"{', '.join(sorted(set(others)))}")
    return tools or None


def _options(body: dict[str, Any], settings: ServerSettings, chat: bool) -> Request:
    """The body's options over the server's defaults, checked; errors name the body's field."""
    if not chat:
        request = bodies.options(body, settings, {**_COMPLETION_LOGPROBS, **_OPTIONS})
        return replace(request, logprobs=True) if body.get("logprobs") is not None else request
    wanted = field(body, "logprobs", bool, False)
    if field(body, "top_logprobs", int) is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return bodies.options(body, settings, {**_CHAT_LOGPROBS, **_OPTIONS})


def _tool_choice(body: dict[str, Any], tools: list[Any] | None) -> Choice:
    """``tool_choice``: auto, none, required, a function by name, or ``allowed_tools`` (a subset, auto or
    required)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return Choice(choice or "auto")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("function"), dict):
        return Choice("required", checked_names([choice["function"].get("name")], tools, "tool_choice.function.name"))
    allowed = choice.get("allowed_tools") if kind == "allowed_tools" else None
    if isinstance(allowed, dict) and allowed.get("mode") in ("auto", "required") and \
            isinstance(allowed.get("tools"), list):
        names = [(t.get("function") or {}).get("name") if isinstance(t, dict) else None for t in allowed["tools"]]
        return Choice(allowed["mode"], checked_names(names, tools, "tool_choice.allowed_tools.tools"))
    raise ApiError(400, "'tool_choice' must be auto, none, required, {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}} or {\"type\": \"allowed_tools\", ...}", param="tool_choice")


def _strict(tools: list[Any] | None) -> set[str]:
    """The tools whose arguments must validate against their schema (``function.strict``)."""
    return {f["name"] for f in functions(tools) if f.get("strict") is True}


def _prompt(body: dict[str, Any], chat: bool, options: Request, settings: ServerSettings,
            images: list[tuple[Image, str]]) -> Request:
    """``options`` with the body's messages (chat) or its prompt (the legacy completions: no chat template); the
    messages' images, each with its field, go into ``images``."""
    if chat:
        messages = field(body, "messages", list, None)
        if not messages:
            raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
        return replace(options, messages=[_message(m, i, settings, images) for i, m in enumerate(messages)])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return replace(options, prompt=prompt, ignore_chat_template=True)


def _message(m: Any, i: int, settings: ServerSettings, images: list[tuple[Image, str]]) -> dict[str, Any]:
    """A chat message for the template: string content, or the text of its parts; with ``image_url`` parts, the
    parts (each image a ``{"type": "image"}`` part, its image in ``images``)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'role'", param=where)
    if m["role"] == "developer":  # OpenAI's newer name for the system turn, which templates do not know
        m = {**m, "role": "system"}
    content = m.get("content")
    if isinstance(content, list):
        parts: list[dict[str, str]] = []
        for j, p in enumerate(content):
            at = f"{where}.content[{j}]"
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif isinstance(p, dict) and p.get("type") == "image_url":
                url = p.get("image_url")
                images.append((bodies.image_from_uri(url.get("url") if isinstance(url, dict) else url, at, settings),
                               at))
                parts.append({"type": "image"})
            else:
                raise ApiError(400, f"'{where}.content' may hold only text and image_url parts",
                               param=f"{where}.content")
        if any(part["type"] == "image" for part in parts):
            return {**m, "content": parts}
        content = "".join(part["text"] for part in parts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
    message = {**m, "content": content if content is not None else ""}
    if isinstance(m.get("tool_calls"), list):
        message["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    return message


def _call(call: Any, where: str) -> Any:
    """An earlier tool call with its arguments (OpenAI's JSON text) as an object, as ``mlx_lm.server`` and
    mlx-vlm's server give it to the template (which writes it with ``tojson``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance((arguments := function.get("arguments")), str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise ApiError(400, f"'{where}.function.arguments' must be a JSON object as a string",
                       param=f"{where}.function.arguments") from None
    return {**call, "function": {**function, "arguments": parsed}}
