"""Anthropic Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``) as a typed
``mlxpipe.protocol.request.Request``.

Content blocks become the chat messages a chat template reads, as ``mlx_lm.server`` gives them to it: ``text``
blocks are joined, an assistant's ``tool_use`` blocks become its ``tool_calls`` (arguments as an object), a user's
``tool_result`` blocks become ``tool`` messages (before the user's own text), ``thinking`` blocks of earlier turns
are dropped, and ``system`` messages inside ``messages`` (Claude Code sends one mid-conversation) are system turns
where they stand (``bodies.tokens_for`` merges them where the template takes one); images (to a text-only model) and
documents are refused (400). A last assistant message is a prefill: the reply continues it, as Anthropic's API does.
``tools`` (``name``, ``description``, ``input_schema``) go to the template as function tools; Anthropic's built-in
tools (``web_search_...``, ``code_execution_...``, ``bash_...``: its servers run them, or only its models know their
schema) are left out and named in the request's notes. ``tool_choice`` ``none`` withholds the tools, ``any`` and
``tool`` reach the template as its ``tool_choice`` variable and are enforced by the grammar engine
(``serve.tool_choice``), as strict tools (``strict: true``) and ``disable_parallel_tool_use`` are. ``thinking`` is
the template's thinking switch (``bodies.thinking``), ``output_config.format`` a structured output;
``cache_control``, ``metadata``, ``context_management``, ``service_tier`` and the rest of what Claude Code sends are
accepted (the prompt cache needs no marks: it keeps every prefix). A user's ``image`` blocks with a ``base64``
source go to a vision-language model (``bodies.tokens_and_images``), with the tools, the thinking switch and a
prefill, as without images; so do those inside a ``tool_result`` (a tool's screenshot). Every error names the field
(``messages[1].content[0].tool_use_id``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.request import Image, Request, RequestError
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import field
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.tool_choice import Choice, checked_names, enforce

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Body field -> Request field: Anthropic's sampling fields, then mlx-lm's (through the SDKs' extra_body).
_OPTIONS = {"max_tokens": "max_tokens", "temperature": "temp", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
            "chat_template_kwargs": "chat_template_config"}
_MEDIA = {"image": "an image", "document": "a document", "search_result": "a search result",
          "container_upload": "a file"}
# Blocks of earlier turns from tools Anthropic ran on its own servers: nothing a local model wrote, dropped.
_HOSTED_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "mcp_tool_use",
                  "mcp_tool_result", "tool_search_tool_result")
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}


@dataclass
class Parsed:
    """A validated Messages body."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    stops: list[str]
    tools: list[dict[str, Any]] | None  # as the template and mlx-lm's tool parser read them
    model: str = ""  # the name the body gave the model, echoed back
    notes: bodies.Notes = dc_field(default_factory=list)  # what was dropped or mapped


def parse(body: dict[str, Any], settings: ServerSettings, tokenizer: TokenizerWrapper, new_id: Callable[[], str],
          counting: bool = False) -> Parsed:
    """``body`` checked and turned into a request for the ranks; ``counting``: for ``count_tokens`` (no
    ``max_tokens`` needed). Raises ``ApiError``."""
    model = bodies.check_model(body, settings)
    if not counting and body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required: the most tokens the reply may have", param="max_tokens")
    notes: bodies.Notes = []
    request = _with_format(bodies.options(body, settings, _OPTIONS), body, settings)
    request = bodies.thinking(request, body, _thinking(body, notes))
    tools = _tools(body, notes)
    choice, parallel = _tool_choice(body, tools)
    images: list[tuple[Image, str]] = []
    messages, prefill = chat_messages(body, notes, settings, images)
    if prefill is not None and choice.mode == "required":
        raise ApiError(400, "'tool_choice' cannot force a tool call after a prefilled reply (a last assistant "
                            "message): the call starts at the reply's first token", param="tool_choice")
    request = replace(request, messages=messages, prefill_response=prefill)
    offered = tools if choice.mode != "none" else None
    value = choice.template_value()
    extra = {"tool_choice": value} if offered and value is not None else None
    _unhonoured(body, notes)
    tokens, pictures, vision_prompt = bodies.tokens_and_images(tokenizer, request, images, offered, extra, "messages",
                                                               settings, notes)
    request = replace(request, images=pictures, vision_prompt=vision_prompt)
    ranked = enforce(bodies.for_ranks(request, tokens, settings, "messages", new_id,
                                      {"response_format": "output_config.format"}, notes),
                     offered, choice, parallel, _strict(body), tokenizer, settings)
    return Parsed(ranked, field(body, "stream", bool, False), bodies.stops(body, "stop_sequences"), offered, model,
                  notes)


def _thinking(body: dict[str, Any], notes: bodies.Notes) -> bool | None:
    """``thinking`` (``enabled`` with a budget, ``adaptive``, ``disabled``) as the template's switch; a budget is
    not kept (the reply's ``max_tokens`` bounds the thinking too)."""
    thinking = field(body, "thinking", dict)
    if thinking is None:
        return None
    kind = field(thinking, "type", str, None, "thinking.")
    if kind not in _THINKING:
        raise ApiError(400, "'thinking.type' must be enabled, adaptive or disabled", param="thinking.type")
    notes.append(f"thinking {kind} -> the template's thinking switch {'on' if _THINKING[kind] else 'off'}")
    return _THINKING[kind]


def _with_format(request: Request, body: dict[str, Any], settings: ServerSettings) -> Request:
    """``output_config.format`` (or the older ``output_format``), a JSON schema the reply must follow, as the chat
    API's ``response_format``: constrained decoding on the ranks."""
    config = field(body, "output_config", dict) or {}
    fmt, name = (config.get("format"), "output_config.format") if config.get("format") is not None else \
        (body.get("output_format"), "output_format")
    if fmt is None:
        return request
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, f"'{name}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=name)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    try:
        request = replace(request, response_format=response_format).check(lambda key: f"'{name}'",
                                                                             settings.vocab_size)
    except RequestError as e:
        raise ApiError(400, e.message, param=name) from None
    bodies.check_schema(response_format, name)
    return request


def _unhonoured(body: dict[str, Any], notes: bodies.Notes) -> None:
    """What a local server cannot do, said in the notes: Anthropic's server-side context editing and MCP
    connectors, and a reasoning effort (the template's thinking switch is all there is)."""
    if field(body, "context_management", dict):
        notes.append("context_management not applied: this server edits no context")
    if field(body, "mcp_servers", list):
        notes.append("mcp_servers left out: this server connects to none")
    effort = (field(body, "output_config", dict) or {}).get("effort")
    if effort is not None:
        notes.append(f"output_config.effort {str(effort)[:20]} not applied")


def chat_messages(body: dict[str, Any], notes: bodies.Notes | None = None,
                  settings: ServerSettings | None = None, images: list[tuple[Image, str]] | None = None
                  ) -> tuple[list[dict[str, Any]], str | None]:
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
    dropped: list[str] = []  # blocks of tools Anthropic ran: none of them reach the template
    for i, message in enumerate(messages):
        out.extend(_message(message, f"messages[{i}]", names, dropped, settings, images))
    if dropped and notes is not None:
        notes.append(f"earlier turns' hosted tool blocks dropped: {', '.join(sorted(set(dropped)))}")
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


def _message(message: Any, where: str, names: dict[str, str], dropped: list[str],
             settings: ServerSettings | None = None, images: list[tuple[Image, str]] | None = None
             ) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results come first, as ``tool`` messages; a system
    (or developer) message is a system turn where it stands."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"'{where}' must be an object with a 'role' of 'user', 'assistant' or 'system'",
                       param=where)
    role, content = message["role"], message.get("content")
    if role in ("system", "developer"):
        if isinstance(content, list):
            return [{"role": "system", "content": _texts(content, f"{where}.content")}]
        return [{"role": "system", "content": field(message, "content", str, "", f"{where}.")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or a list of content blocks",
                       param=f"{where}.content")
    texts, calls, results = [], [], []
    parts: list[dict[str, str]] = []  # the user's text and images in order, where it sends images
    # A vision-language model's images: the tool results' (a screenshot a tool took) and the user's own, in the
    # order the template shows them (the tool messages first).
    vision = settings if images is not None and settings is not None and settings.vision is not None else None
    answers: list[tuple[Image, str]] = []
    own: list[tuple[Image, str]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(block)
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user" and vision is not None:
            own.append(_image(block, at, vision))
            parts.append({"type": "image"})
        elif kind in _MEDIA:
            raise bodies.image_refused(at, _MEDIA[kind], settings if role == "user" else None)
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
            shown: str | list[dict[str, str]]
            if not isinstance(result, list):
                shown = field(block, "content", str, "", f"{at}.")
            elif vision is not None:
                shown = _result(result, f"{at}.content", vision, answers)
            else:
                shown = _texts(result, f"{at}.content")
            tool = {"role": "tool", "tool_call_id": answered, "content": shown}
            if answered in names:
                tool["name"] = names[answered]
            results.append(tool)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' reasoning: templates drop it too
        elif kind in _HOSTED_BLOCKS:
            dropped.append(kind)
        else:
            allowed = "text, tool_use or thinking" if role == "assistant" else "text or tool_result"
            raise ApiError(400, f"'{at}' must be a {allowed} block, got type {str(kind)[:40]!r}", param=at)
    if images is not None:
        images.extend(answers + own)
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


def _image(block: dict[str, Any], at: str, settings: ServerSettings) -> tuple[Image, str]:
    """An ``image`` block's picture, with its field: a base64 source (a url one only once fetched, with the flag)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url":  # fetched before parsing, with the flag
        raise ApiError(400, f"'{at}.source': url sources are fetched only by a server started with "
                            "--allow-image-urls: send a base64 source, or restart mlxpipe serve with "
                            "--allow-image-urls", param=f"{at}.source", code="invalid_image")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise ApiError(400, f"'{at}.source' must be a base64 source (type 'base64', 'media_type', 'data')",
                       param=f"{at}.source")
    return bodies.image_from_base64(source.get("data"), f"{at}.source.data", settings), at


def _result(blocks: list[Any], where: str, settings: ServerSettings, images: list[tuple[Image, str]]
            ) -> str | list[dict[str, str]]:
    """A tool_result's content for a vision-language model: its text, or, with ``image`` blocks (their pictures
    into ``images``), its text and image parts in order, as mlx-vlm's server gives them to the template."""
    if not any(_kind(block) == "image" for block in blocks):
        return _texts(blocks, where)
    parts = []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", _kind(block)
        if kind == "image":
            images.append(_image(block, at, settings))
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        else:
            raise ApiError(400, f"'{at}' must be a text or image block, got type {str(kind)[:40]!r}", param=at)
    return parts


def _tools(body: dict[str, Any], notes: bodies.Notes) -> list[dict[str, Any]] | None:
    built_ins: list[str] = []

    def convert(tool: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(tool, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where)
        kind = _kind(tool, "custom")
        if kind != "custom" and bodies.built_in(kind):
            built_ins.append(str(tool.get("name") or kind))
            return []
        if kind != "custom" or "input_schema" not in tool:
            raise ApiError(400, f"'{where}' must be a client tool with an 'input_schema', got type "
                                f"{str(tool.get('type'))[:40]!r}", param=where)
        return [bodies.function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)]

    tools = bodies.tool_list(body, convert)
    bodies.left_out(notes, built_ins)
    return tools or None


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[Choice, bool]:
    """``auto``, ``any`` (required), ``none`` or a ``tool`` by name, which must be one of ``tools``; and whether
    several calls may come (``disable_parallel_tool_use`` says not)."""
    choice = field(body, "tool_choice", dict)
    if choice is None:
        return Choice(), True
    kind = _kind(choice)
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")
    parallel = not field(choice, "disable_parallel_tool_use", bool, False, "tool_choice.")
    if kind == "tool":
        return Choice("required", checked_names([choice.get("name")], tools, "tool_choice.name")), parallel
    return Choice("required" if kind == "any" else kind), parallel


def _strict(body: dict[str, Any]) -> set[str]:
    """The tools whose input must validate against their ``input_schema`` (``strict: true``)."""
    given = body.get("tools")
    tools: list[Any] = given if isinstance(given, list) else []
    return {t["name"] for t in tools
            if isinstance(t, dict) and t.get("strict") is True and isinstance(t.get("name"), str)}


def _kind(block: Any, default: str | None = None) -> str | None:
    """A block's ``type`` when it is a string (anything else matches no type)."""
    kind = block.get("type", default) if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None
