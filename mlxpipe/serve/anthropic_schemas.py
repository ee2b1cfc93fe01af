"""Anthropic Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``) as a typed
``mlxpipe.protocol.request.Request``.

Content blocks become the chat messages a chat template reads, as ``mlx_lm.server`` gives them to it: ``text``
blocks are joined, an assistant's ``tool_use`` blocks become its ``tool_calls`` (arguments as an object), a user's
``tool_result`` blocks become ``tool`` messages (before the user's own text), ``thinking`` blocks of earlier turns
are dropped; images and documents are refused (400). A last assistant message is a prefill: the reply continues
it, as Anthropic's API does. ``tools`` (``name``, ``description``, ``input_schema``) go to the template as
function tools; ``tool_choice`` ``none`` withholds them, ``any`` and ``tool`` reach the template as its
``tool_choice`` variable (nothing enforces them: that would take constrained decoding). A user's ``image`` blocks
with a ``base64`` source go to a vision-language model (``bodies.with_images``). Every error names the field
(``messages[1].content[0].tool_use_id``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.request import Image, Request
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import field
from mlxpipe.serve.door import ApiError, ServerSettings

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Body field -> Request field: Anthropic's sampling fields, then mlx-lm's (through the SDKs' extra_body).
_OPTIONS = {"max_tokens": "max_tokens", "temperature": "temp", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
            "chat_template_kwargs": "chat_template_config"}
_MEDIA = {"image": "an image", "document": "a document", "search_result": "a search result",
          "container_upload": "a file"}


@dataclass
class Parsed:
    """A validated Messages body."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    stops: list[str]
    tools: list[dict[str, Any]] | None  # as the template and mlx-lm's tool parser read them


def parse(body: dict[str, Any], settings: ServerSettings, tokenizer: TokenizerWrapper, new_id: Callable[[], str],
          counting: bool = False) -> Parsed:
    """``body`` checked and turned into a request for the ranks; ``counting``: for ``count_tokens`` (no
    ``max_tokens`` needed). Raises ``ApiError``."""
    bodies.check_model(body, settings)
    if not counting and body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required: the most tokens the reply may have", param="max_tokens")
    request = bodies.options(body, settings, _OPTIONS)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    images: list[tuple[Image, str]] = []
    messages, prefill = chat_messages(body, settings, images)
    request = replace(request, messages=messages, prefill_response=prefill)
    offered = tools if choice != "none" else None
    extra = {"tool_choice": choice} if offered and choice not in (None, "auto") else None
    if images:
        if offered or prefill is not None:
            what = "'tools'" if offered else "a last assistant message (a prefill)"
            raise ApiError(400, f"{what} cannot go with images on this server yet", param="messages")
        vision = bodies.with_images(request, images, settings, "messages")
        assert vision.tokens is not None  # with_images tokenizes
        tokens = vision.tokens
        request = replace(request, images=vision.images, vision_prompt=vision.vision_prompt)
    else:
        tokens = bodies.tokens_for(tokenizer, request, offered, extra, "messages")
    return Parsed(bodies.for_ranks(request, tokens, settings, "messages", new_id), field(body, "stream", bool, False),
                  bodies.stops(body, "stop_sequences"), offered)


def chat_messages(body: dict[str, Any], settings: ServerSettings | None = None,
                  images: list[tuple[Image, str]] | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The chat template's messages (the system prompt first), and the prefill: a last assistant message's text.

    A user's images go into ``images`` (each with its field), a ``{"type": "image"}`` part in its message; without
    ``images`` (or ``settings``), an image block is refused."""
    messages = field(body, "messages", list)
    if not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    system = _system(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the tool messages that answer it
    for i, message in enumerate(messages):
        out.extend(_message(message, f"messages[{i}]", names, settings, images))
    prefill = None
    last = out[-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        prefill = out.pop()["content"]
    return out, prefill


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if isinstance(system, list):
        return _texts(system, "system")
    raise ApiError(400, "'system' must be a string or a list of text blocks", param="system")


def _texts(blocks: list[Any], where: str) -> str:
    """The text of a list of blocks that may hold only text."""
    texts = []
    for j, block in enumerate(blocks):
        kind = _kind(block)
        if kind in _MEDIA:
            raise bodies.image_refused(f"{where}[{j}]", _MEDIA[kind])
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"'{where}[{j}]' must be a text block ({{\"type\": \"text\", \"text\": ...}})",
                           param=f"{where}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def _message(message: Any, where: str, names: dict[str, str], settings: ServerSettings | None = None,
             images: list[tuple[Image, str]] | None = None) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results come first, as ``tool`` messages."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"'{where}' must be an object with a 'role' of 'user' or 'assistant'", param=where)
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or a list of content blocks",
                       param=f"{where}.content")
    texts, calls, results = [], [], []
    parts: list[dict[str, str]] = []  # the user's text and images in order, where it sends images
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(block)
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user" and images is not None and settings is not None and settings.vision:
            source = block.get("source")
            if not isinstance(source, dict) or source.get("type") != "base64":
                raise ApiError(400, f"'{at}.source' must be a base64 source (type 'base64', 'media_type', 'data')",
                               param=f"{at}.source")
            images.append((bodies.image_from_base64(source.get("data"), f"{at}.source.data", settings), at))
            parts.append({"type": "image"})
        elif kind in _MEDIA:
            raise bodies.image_refused(at, _MEDIA[kind])
        elif kind == "tool_use" and role == "assistant":
            call_id = field(block, "id", str, "", f"{at}.")
            name = field(block, "name", str, None, f"{at}.")
            if not name:
                raise ApiError(400, f"'{at}.name' must name the tool", param=f"{at}.name")
            names[call_id] = name
            calls.append(bodies.tool_call(call_id, name, field(block, "input", dict, {}, f"{at}.")))
        elif kind == "tool_result" and role == "user":
            answered = field(block, "tool_use_id", str, None, f"{at}.")
            if answered is None:
                raise ApiError(400, f"'{at}.tool_use_id' must name the tool_use it answers", param=f"{at}.tool_use_id")
            result = block.get("content")
            text = _texts(result, f"{at}.content") if isinstance(result, list) else field(block, "content", str, "",
                                                                                          f"{at}.")
            tool = {"role": "tool", "tool_call_id": answered, "content": text}
            if answered in names:
                tool["name"] = names[answered]
            results.append(tool)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' reasoning: templates drop it too
        else:
            allowed = "text, tool_use or thinking" if role == "assistant" else "text or tool_result"
            raise ApiError(400, f"'{at}' must be a {allowed} block, got type {str(kind)[:40]!r}", param=at)
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    elif any(part["type"] == "image" for part in parts):
        out.append({"role": "user", "content": parts})
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    return bodies.tool_list(body, _tool) or None


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ApiError(400, f"'{where}' must be an object", param=where)
    if _kind(tool, "custom") != "custom" or "input_schema" not in tool:
        raise ApiError(400, f"'{where}' must be a client tool with an 'input_schema'; server tools "
                            f"({str(tool.get('type'))[:40]}) are not run by this server", param=where)
    return bodies.function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """``auto``, ``any``, ``none`` or the tool's name, for the template; it must name a tool in ``tools``."""
    choice = field(body, "tool_choice", dict)
    if choice is None:
        return None
    kind = _kind(choice)
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")
    if kind == "tool":
        name = choice.get("name")
        if not tools or not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"'tool_choice.name' must name one of 'tools', got {str(name)[:60]!r}",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind == "any":
        return "required"  # the templates that know tool_choice know OpenAI's words
    return kind


def _kind(block: Any, default: str | None = None) -> str | None:
    """A block's ``type`` when it is a string (anything else matches no type)."""
    kind = block.get("type", default) if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None
