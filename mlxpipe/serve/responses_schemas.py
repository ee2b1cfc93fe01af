"""OpenAI Responses bodies (``/v1/responses``) as a typed ``mlxpipe.protocol.request.Request``.

``input`` (a string, or a list of message, ``function_call`` and ``function_call_output`` items) becomes the chat
messages a template reads, after the conversation of ``previous_response_id`` (from ``responses_store``) and after
``instructions`` (a system message, never carried over, as OpenAI's API does). Function ``tools`` go to the
template; ``tool_choice`` ``none`` withholds them, ``required`` and a named function reach the template as its
``tool_choice`` variable. Images and files are refused (400). Every error names the field (``input[2].call_id``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.request import Image, Request, RequestError
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import field
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.responses_store import ResponseStore

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Body field -> Request field: the Responses API's sampling fields, then mlx-lm's (through extra_body).
_OPTIONS = {"max_output_tokens": "max_tokens", "temperature": "temp", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
            "chat_template_kwargs": "chat_template_config"}
_MEDIA = {"input_image": "an image", "input_file": "a file", "input_audio": "audio"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass
class Parsed:
    """A validated Responses body, with what the response echoes back."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    store: bool
    conversation: list[dict[str, Any]]  # every message but the instructions: what a follow-up continues
    tools: list[dict[str, Any]] | None  # as the template and mlx-lm's tool parser read them
    echo: dict[str, Any]  # the request's fields a response object repeats


def parse(body: dict[str, Any], settings: ServerSettings, tokenizer: TokenizerWrapper, new_id: Callable[[], str],
          store: ResponseStore) -> Parsed:
    """``body`` checked and turned into a request for the ranks; raises ``ApiError``."""
    bodies.check_model(body, settings)
    _refuse_unsupported(body)
    request = _with_format(bodies.options(body, settings, _OPTIONS), body, settings)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    conversation = _previous(body, store) + input_messages(body.get("input"), settings)
    instructions = field(body, "instructions", str)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    offered = tools if choice != "none" else None
    extra = {"tool_choice": choice} if offered and choice not in (None, "auto") else None
    images = _images(conversation)
    if images:
        if offered:
            raise ApiError(400, "'tools' cannot go with images on this server yet", param="tools")
        vision = bodies.with_images(replace(request, messages=messages), images, settings, "input")
        assert vision.tokens is not None  # with_images tokenizes
        tokens = vision.tokens
        request = replace(request, images=vision.images, vision_prompt=vision.vision_prompt)
    else:
        tokens = bodies.tokens_for(tokenizer, replace(request, messages=messages), offered, extra, "input")
    # text.format is the body's name of the structured output a server with a draft model refuses.
    ranked = bodies.for_ranks(request, tokens, settings, "input", new_id, {"response_format": "text.format"})
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": request.temp, "top_p": request.top_p, "tool_choice": choice or "auto",
            "tools": field(body, "tools", list, []), "parallel_tool_calls": field(body, "parallel_tool_calls", bool,
                                                                                 True),
            "previous_response_id": body.get("previous_response_id"), "metadata": field(body, "metadata", dict, {}),
            "text": {"format": {"type": "text"}}}
    return Parsed(ranked, field(body, "stream", bool, False), field(body, "store", bool, True), conversation, offered,
                  echo)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """What this server does not do yet, refused rather than ignored."""
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise ApiError(400, "'top_logprobs' is not supported by this server's Responses API yet", param="top_logprobs")
    if body.get("conversation") is not None:
        raise ApiError(400, "'conversation' (stored conversations) is not supported; chain responses with "
                            "'previous_response_id'", param="conversation")


def _with_format(request: Request, body: dict[str, Any], settings: ServerSettings) -> Request:
    """``text.format`` (structured output) as the chat API's ``response_format``: constrained decoding on the ranks.

    Responses spell a schema flat (``{"type": "json_schema", "name", "schema", "strict"}``), chat nests it under
    ``json_schema``; both reach the grammar engine in chat's shape.
    """
    fmt = field(body, "text", dict, {}).get("format")
    if fmt is None:
        return request
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    try:
        request = replace(request, response_format=fmt).check(lambda key: "'text.format'", settings.vocab_size)
    except RequestError as e:
        raise ApiError(400, e.message, param="text.format") from None
    if request.response_format is not None:
        bodies.check_schema(request.response_format, "text.format")
    return request


def _previous(body: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    previous = field(body, "previous_response_id", str)
    if previous is None:
        return []
    stored = store.get(previous)
    if stored is None:
        raise ApiError(400, f"'previous_response_id': no response {previous[:60]!r} is kept (this server keeps the "
                            f"last {store.capacity} stored responses for {store.ttl:g} s, in memory)",
                       param="previous_response_id", code="previous_response_not_found")
    return [dict(m) for m in stored.messages]


def _images(conversation: list[dict[str, Any]]) -> list[tuple[Image, str]]:
    """The images of the conversation's image parts (a stored turn's too: a follow-up sees its pictures), in order,
    each with the field it came from."""
    found = []
    for message in conversation:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image":
                found.append((Image(data=part["image_data"], sha256=part["sha256"]), part["where"]))
    return found


def input_messages(value: Any, settings: ServerSettings | None = None) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls become one assistant message's ``tool_calls``; a
    vision-language model's (``settings.vision``) ``input_image`` parts become image parts that carry the image."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = _kind(item, "message")
        if kind == "message":
            out.append(_message(item, where, settings))
        elif kind == "function_call":
            call_id = field(item, "call_id", str, None, f"{where}.")
            name = field(item, "name", str, None, f"{where}.")
            if not call_id or not name:
                raise ApiError(400, f"'{where}' needs a 'call_id' and a 'name'", param=where)
            names[call_id] = name
            call = bodies.tool_call(call_id, name, _arguments(field(item, "arguments", str, "{}", f"{where}."),
                                                              f"{where}.arguments"))
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = field(item, "call_id", str, None, f"{where}.")
            if not call_id:
                raise ApiError(400, f"'{where}.call_id' must name the function call it answers",
                               param=f"{where}.call_id")
            output = item.get("output")
            text = _parts(output, f"{where}.output") if isinstance(output, list) else field(item, "output", str, "",
                                                                                           f"{where}.")
            tool = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: templates drop it too
        else:
            raise ApiError(400, f"'{where}' must be a message, function_call or function_call_output item, got "
                                f"type {str(kind)[:40]!r}", param=where)
    return out


def _message(item: dict[str, Any], where: str, settings: ServerSettings | None = None) -> dict[str, Any]:
    role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
    if role is None:
        raise ApiError(400, f"'{where}.role' must be user, assistant, system or developer", param=f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts(content, f"{where}.content", settings)
    return {"role": role, "content": text}


def _parts(parts: Any, where: str, settings: ServerSettings | None = None) -> str | list[dict[str, str]]:
    """The text of a message's content parts (``input_text``, ``output_text``, ``text``); with a vision-language
    model's ``input_image`` parts (``data:`` URIs), the parts, each image one that carries it."""
    if not isinstance(parts, list):
        raise ApiError(400, f"'{where}' must be a string or a list of text parts", param=where)
    out: list[dict[str, str]] = []
    for j, part in enumerate(parts):
        kind = _kind(part)
        if kind == "input_image" and settings is not None and settings.vision is not None:
            at = f"{where}[{j}]"
            image = bodies.image_from_uri(part.get("image_url"), f"{at}.image_url", settings)
            out.append({"type": "image", "image_data": image.data, "sha256": image.sha256, "where": at})
            continue
        if kind in _MEDIA:
            raise bodies.image_refused(f"{where}[{j}]", _MEDIA[kind])
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(400, f"'{where}[{j}]' must be an input_text part", param=f"{where}[{j}]")
        out.append({"type": "text", "text": part["text"]})
    if any(part["type"] == "image" for part in out):
        return out
    return "".join(part["text"] for part in out)


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        raise ApiError(400, f"'{where}' must be a JSON object as a string", param=where) from None


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    return bodies.tool_list(body, _tool) or None


def _tool(tool: Any, where: str) -> dict[str, Any]:
    kind = _kind(tool)
    if kind != "function":
        raise ApiError(400, f"'{where}' must be a function tool; built-in tools ({str(kind)[:40]}) are not "
                            "run by this server", param=where)
    return bodies.function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), where)


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in ("auto", "none", "required")):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not tools or not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"'tool_choice.name' must name one of 'tools', got {str(name)[:60]!r}",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(400, "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _kind(block: Any, default: str | None = None) -> str | None:
    """A block's ``type`` when it is a string (anything else matches no type)."""
    kind = block.get("type", default) if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None
