"""Ollama's request bodies (``/api/chat``, ``/api/generate``) as a typed ``mlxpipe.protocol.request.Request``.

Sampling comes in ``options`` under Ollama's names (``num_predict``, ``repeat_penalty``, ``stop``...), messages as
Ollama sends them (an assistant's ``tool_calls`` with object arguments, ``tool`` messages with ``tool_name``), and
``/api/generate``'s prompt goes through the chat template unless ``raw``; ``think`` is the template's thinking
switch. Images (base64, a message's ``images`` or ``/api/generate``'s) go to a vision-language model
(``bodies.with_images``), and are refused with a 400 by a text-only one; ``format`` (structured output) is refused
with a 400; options that tune Ollama's own runtime (``num_ctx``, ``num_thread``...) are ignored.
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
from mlxpipe.serve.tool_choice import Choice, enforce

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# options field -> Request field.
_OPTIONS = {"num_predict": "max_tokens", "temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "seed": "seed", "repeat_penalty": "repetition_penalty", "repeat_last_n": "repetition_context_size",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


@dataclass
class Parsed:
    """A validated Ollama body."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    stops: list[str]
    tools: list[dict[str, Any]] | None
    model: str  # the name the client used, echoed back
    notes: bodies.Notes = dc_field(default_factory=list)  # what was dropped or mapped


def served_name(settings: ServerSettings) -> str:
    """The model's name in Ollama's lists: the ``--model`` value."""
    return settings.model_id


def check_model(body: dict[str, Any], settings: ServerSettings) -> str:
    """The model named (Ollama's clients add ``:latest``), which must be one this server answers to
    (``ServerSettings.answers_to``); 404 otherwise."""
    model: str = field(body, "model", str, settings.model_id)
    if not settings.answers_to(model.removesuffix(":latest")):
        raise ApiError(404, f"model {model!r} not found; this server serves {settings.model_id!r} "
                            "(--served-model-name adds names, --any-model-name takes any)", param="model")
    return model


def parse(body: dict[str, Any], chat: bool, settings: ServerSettings, tokenizer: TokenizerWrapper,
          new_id: Callable[[], str]) -> Parsed:
    """``body`` checked and turned into a request for the ranks; raises ``ApiError``."""
    model = check_model(body, settings)
    if body.get("format") not in (None, ""):
        # Structured output (format "json" or a schema) would map to Request.response_format once the grammar
        # engine has landed; refused until then, never silently unconstrained.
        raise ApiError(400, "'format' (structured output) is not supported by this server yet", param="format")
    if body.get("images") and (chat or settings.vision is None):
        raise bodies.image_refused("images", "an image", None if chat else settings)
    images: list[tuple[Image, str]] = []
    options = field(body, "options", dict, {})
    request = _options(options, settings)
    stops = bodies.stops(options, "stop")
    tools = _tools(body) if chat else None
    param = "messages" if chat else "prompt"
    notes: bodies.Notes = []
    request = bodies.thinking(request, body, _think(body, notes))
    if chat:
        request = replace(request, messages=_messages(field(body, "messages", list), settings, images))
    else:
        prompt = field(body, "prompt", str, "")
        if not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        raw = field(body, "raw", bool, False)
        system = field(body, "system", str)
        request = replace(request, prompt=prompt, ignore_chat_template=raw,
                          system_prompt=system if system is not None else request.system_prompt)
        images.extend(_images(body.get("images"), "images", settings))
        if images and (raw or system is not None):
            what = "raw" if raw else "system"
            raise ApiError(400, f"'{what}' cannot go with images on this server yet", param=what)
    tokens, pictures, vision_prompt = bodies.tokens_and_images(tokenizer, request, images, tools, None, param,
                                                               settings, notes)
    request = replace(request, images=pictures, vision_prompt=vision_prompt)
    # Ollama has no tool_choice: a call the model starts is completed under the grammar.
    ranked = enforce(bodies.for_ranks(request, tokens, settings, param, new_id, {"max_tokens": "options.num_predict"},
                                      notes), tools, Choice(), True, (), tokenizer, settings)
    return Parsed(ranked, field(body, "stream", bool, True), stops, tools, model, notes)


def _think(body: dict[str, Any], notes: bodies.Notes) -> bool | None:
    """Ollama's ``think`` (true, false, or a level: ``low``, ``medium``, ``high``) as the template's switch."""
    think = body.get("think")
    if think is None:
        return None
    if not isinstance(think, (bool, str)):
        raise ApiError(400, "'think' must be true, false, or low, medium or high", param="think")
    notes.append(f"think {json.dumps(think)} -> the template's thinking switch {'on' if think else 'off'}")
    return bool(think)


def _options(options: dict[str, Any], settings: ServerSettings) -> Any:
    values = dict(options)
    if values.get("num_predict") in (-1, -2):  # Ollama's "until the context ends"
        values["num_predict"] = settings.context
    try:
        return bodies.options(values, settings, _OPTIONS)
    except ApiError as e:
        raise ApiError(e.status, e.message.replace(f"'{e.param}'", f"'options.{e.param}'"),
                       param=f"options.{e.param}") from None


def _images(value: Any, where: str, settings: ServerSettings) -> list[tuple[Image, str]]:
    """A list of base64 images (Ollama's ``images``), each checked, with its field."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be a list of base64 images", param=where)
    return [(bodies.image_from_base64(data, f"{where}[{k}]", settings), f"{where}[{k}]")
            for k, data in enumerate(value)]


def _messages(messages: list[Any] | None, settings: ServerSettings,
              images: list[tuple[Image, str]]) -> list[dict[str, Any]]:
    if not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"'{where}' must be an object with a 'role' of system, user, assistant or tool",
                           param=where)
        if m.get("images") and settings.vision is None:
            raise bodies.image_refused(f"{where}.images", "an image", settings)
        content = field(m, "content", str, "", f"{where}.")
        pictures = _images(m.get("images"), f"{where}.images", settings)
        images.extend(pictures)
        parts = [*({"type": "image"} for _ in pictures), {"type": "text", "text": content}]
        message: dict[str, Any] = {"role": m["role"], "content": parts if pictures else content}
        calls = field(m, "tool_calls", list, None, f"{where}.")
        if calls:
            message["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", i, j) for j, c in enumerate(calls)]
        name = m.get("tool_name") or m.get("name")
        if m["role"] == "tool" and isinstance(name, str):
            message["name"] = name
        out.append(message)
    return out


def _call(call: Any, where: str, i: int, j: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"'{where}.function' must name the function", param=f"{where}.function")
    arguments = field(function, "arguments", dict, {}, f"{where}.function.")
    return bodies.tool_call(f"call_{i}_{j}", function["name"], arguments)


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    return bodies.tool_list(body, _tool) or None


def _tool(tool: Any, where: str) -> list[dict[str, Any]]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        raise ApiError(400, f"'{where}' must be a function tool ({{\"type\": \"function\", \"function\": "
                            "...}})", param=where)
    return [bodies.function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                 f"{where}.function")]
