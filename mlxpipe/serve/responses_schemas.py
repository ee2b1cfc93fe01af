"""OpenAI Responses bodies (``/v1/responses``) as a typed ``mlxpipe.protocol.request.Request``.

``input`` (a string, or a list of message, ``function_call`` and ``function_call_output`` items) becomes the chat
messages a template reads, after the conversation of ``previous_response_id`` (from ``responses_store``) and after
``instructions`` (a system message, never carried over, as OpenAI's API does); ``developer`` messages are system
turns where they stand. Function ``tools`` go to the template, and so do the functions of a ``namespace`` (flattened:
``namespace__name``, the name a call comes back under, split again) and ``custom`` tools (a function of one string,
``input``; its call comes back as a ``custom_tool_call``), whether in ``tools`` or in an ``additional_tools`` input
item (Codex sends both). OpenAI's built-in tools (``web_search``, ``file_search``, ``code_interpreter``,
``computer_use``, MCP connectors, ``local_shell``...) are left out, and their earlier calls dropped, named in the
request's notes.
``tool_choice`` ``none`` withholds the tools, ``required`` and a named function reach the template as its
``tool_choice`` variable and are enforced by the grammar engine (``serve.tool_choice``), as ``allowed_tools``,
strict tools (``strict: true``) and ``parallel_tool_calls`` are. ``reasoning.effort`` is the template's thinking
switch (``bodies.thinking``); ``prompt_cache_key``, ``include``, ``store``, ``client_metadata``, ``text.verbosity``
and the like are accepted.
A vision-language model's ``input_image`` parts (``data:`` URIs) go to its processor with the tools and the thinking
switch (``bodies.tokens_and_images``); files, and images to a text-only model, are refused (400). Every error names
the field (``input[2].call_id``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.request import Image, Request, RequestError
from mlxpipe.serve import bodies
from mlxpipe.serve.bodies import field
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.responses_store import ResponseStore
from mlxpipe.serve.tool_choice import Choice, checked_names, enforce

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Body field -> Request field: the Responses API's sampling fields, then mlx-lm's (through extra_body).
_OPTIONS = {"max_output_tokens": "max_tokens", "temperature": "temp", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "seed": "seed", "repetition_penalty": "repetition_penalty",
            "chat_template_kwargs": "chat_template_config"}
_MEDIA = {"input_image": "an image", "input_file": "a file", "input_audio": "audio"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# Items of earlier turns from tools OpenAI ran on its own servers, or state only its servers can read: nothing
# the template can show, dropped (and named in the request's notes).
_HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                 "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output",
                 "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "tool_search_call",
                 "tool_search_output", "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
                 "compaction", "compaction_summary", "item_reference")
NAMESPACE_SEPARATOR = "__"
_CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string", "description": "The tool's input."}},
                 "required": ["input"]}


def flat_name(namespace: str | None, name: str) -> str:
    """A namespace's function as one function name (OpenAI's own default namespace, ``functions``, adds none)."""
    return name if namespace in (None, "", "functions") else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


@dataclass(frozen=True)
class Origin:
    """Where a tool the template sees came from: its name in the body, its namespace, a custom tool or not."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class Toolbox:
    """The body's tools as the template reads them (function tools), and where each came from."""

    tools: list[dict[str, Any]] = dc_field(default_factory=list)
    origins: dict[str, Origin] = dc_field(default_factory=dict)  # the template's name -> the body's
    built_ins: list[str] = dc_field(default_factory=list)  # left out
    unknown: list[str] = dc_field(default_factory=list)  # tool types this server does not know: left out

    def add(self, tool: Any, where: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """``tool`` (a function, a custom tool, a namespace of them, or a built-in tool) as function tools."""
        kind = _kind(tool)
        if not isinstance(tool, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where)
        if kind == "namespace" and namespace is None:
            inner = field(tool, "tools", list, [], f"{where}.")
            ns = field(tool, "name", str, None, f"{where}.")
            if not ns:
                raise ApiError(400, f"'{where}.name' must name the namespace", param=f"{where}.name")
            return [t for j, sub in enumerate(inner) for t in self.add(sub, f"{where}.tools[{j}]", ns)]
        if kind in ("function", "custom"):
            name = tool.get("name")
            custom = kind == "custom"
            parameters = _CUSTOM_INPUT if custom else tool.get("parameters")
            description = tool.get("description")
            if custom and isinstance((fmt := tool.get("format")), dict) and fmt.get("type") == "grammar":
                description = f"{description or ''}\n(input: text in the {fmt.get('syntax', '')} grammar: " \
                              f"{str(fmt.get('definition', ''))[:2000]})".strip()
            made = bodies.function_tool(name, description, parameters, where)  # checks the name is a string
            name = made["function"]["name"]
            flat = flat_name(namespace, name)
            made["function"]["name"] = flat
            self.origins[flat] = Origin(name, namespace, custom)
            self.tools.append(made)
            return [made]
        if bodies.built_in(kind):
            self.built_ins.append(str(kind))
        else:
            self.unknown.append(str(kind)[:40])
        return []

    def say(self, notes: bodies.Notes) -> None:
        """What was left out, and what was mapped, in the request's notes."""
        bodies.left_out(notes, self.built_ins)
        if self.unknown:
            notes.append(f"tools of unknown types left out: {', '.join(sorted(set(self.unknown)))}")
        spaces = sorted({o.namespace for o in self.origins.values() if o.namespace not in (None, "", "functions")})
        if spaces:
            notes.append(f"namespaces flattened to namespace{NAMESPACE_SEPARATOR}name: {', '.join(spaces)}")
        if any(o.custom for o in self.origins.values()):
            notes.append("custom tools offered as functions of one string, 'input'")

    def origin(self, name: str) -> Origin:
        """Where the tool the model called ``name`` came from (itself, for a name no tool has)."""
        return self.origins.get(name, Origin(name))


@dataclass
class Parsed:
    """A validated Responses body, with what the response echoes back."""

    request: Request  # as the ranks run it: the prompt as token ids
    stream: bool
    store: bool
    conversation: list[dict[str, Any]]  # every message but the instructions: what a follow-up continues
    tools: list[dict[str, Any]] | None  # as the template and mlx-lm's tool parser read them
    echo: dict[str, Any]  # the request's fields a response object repeats
    model: str = ""  # the name the body gave the model, echoed back
    toolbox: Toolbox = dc_field(default_factory=Toolbox)  # where each tool came from: calls map back
    notes: bodies.Notes = dc_field(default_factory=list)  # what was dropped or mapped


def parse(body: dict[str, Any], settings: ServerSettings, tokenizer: TokenizerWrapper, new_id: Callable[[], str],
          store: ResponseStore) -> Parsed:
    """``body`` checked and turned into a request for the ranks; raises ``ApiError``."""
    model = bodies.check_model(body, settings)
    _refuse_unsupported(body)
    notes: bodies.Notes = []
    request = _with_format(bodies.options(body, settings, _OPTIONS), body, settings)
    request = bodies.thinking(request, body, _thinking(body, notes))
    toolbox = Toolbox()
    for i, tool in enumerate(field(body, "tools", list) or []):
        toolbox.add(tool, f"tools[{i}]")
    dropped: list[str] = []
    conversation = _previous(body, store) + input_messages(body.get("input"), toolbox, dropped, settings)
    if len(toolbox.tools) > bodies.MAX_TOOLS:
        raise ApiError(400, f"'tools' takes at most {bodies.MAX_TOOLS} tools, got {len(toolbox.tools)}",
                       param="tools")
    toolbox.say(notes)
    if dropped:
        notes.append(f"earlier turns' hosted tool items dropped: {', '.join(sorted(set(dropped)))}")
    tools = toolbox.tools or None
    choice = _tool_choice(body, tools)
    instructions = field(body, "instructions", str)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    offered = tools if choice.mode != "none" else None
    value = choice.template_value()
    extra = {"tool_choice": value} if offered and value is not None else None
    images = _images(conversation)
    tokens, pictures, vision_prompt = bodies.tokens_and_images(tokenizer, replace(request, messages=messages), images,
                                                               offered, extra, "input", settings, notes)
    request = replace(request, images=pictures, vision_prompt=vision_prompt)
    # text.format is the body's name of the structured output a server with a draft model refuses.
    ranked = bodies.for_ranks(request, tokens, settings, "input", new_id,
                              {"response_format": "text.format", "max_tokens": "max_output_tokens"}, notes)
    parallel = field(body, "parallel_tool_calls", bool, True)
    ranked = enforce(ranked, offered, choice, parallel, _strict(body), tokenizer, settings)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": request.temp, "top_p": request.top_p, "tool_choice": body.get("tool_choice") or "auto",
            "tools": field(body, "tools", list, []), "parallel_tool_calls": parallel,
            "previous_response_id": body.get("previous_response_id"), "metadata": field(body, "metadata", dict, {}),
            "text": {"format": {"type": "text"}}}
    return Parsed(ranked, field(body, "stream", bool, False), field(body, "store", bool, True), conversation, offered,
                  echo, model, toolbox, notes)


def _thinking(body: dict[str, Any], notes: bodies.Notes) -> bool | None:
    """``reasoning.effort`` as the template's thinking switch (``none``: off); a summary is not made."""
    reasoning = field(body, "reasoning", dict)
    effort = field(reasoning, "effort", str, None, "reasoning.") if reasoning else None
    return bodies.effort_switch(effort, "reasoning.effort", notes)


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


def input_messages(value: Any, toolbox: Toolbox | None = None, dropped: list[str] | None = None,
                   settings: ServerSettings | None = None) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls become one assistant message's ``tool_calls``; the
    tools of an ``additional_tools`` item go to ``toolbox``; items of hosted tools are left out (their types
    added to ``dropped``); a vision-language model's (``settings.vision``) ``input_image`` parts, in a message or a
    function call's output (a tool's screenshot), become image parts that carry the image."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    toolbox = toolbox if toolbox is not None else Toolbox()
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = _kind(item, "message")
        if kind == "message":
            out.append(_message(item, where, settings))
        elif kind in ("function_call", "custom_tool_call"):
            call_id = field(item, "call_id", str, None, f"{where}.")
            name = field(item, "name", str, None, f"{where}.")
            if not call_id or not name:
                raise ApiError(400, f"'{where}' needs a 'call_id' and a 'name'", param=where)
            name = flat_name(field(item, "namespace", str, None, f"{where}."), name)
            names[call_id] = name
            arguments = ({"input": field(item, "input", str, "", f"{where}.")} if kind == "custom_tool_call" else
                         _arguments(field(item, "arguments", str, "{}", f"{where}."), f"{where}.arguments"))
            call = bodies.tool_call(call_id, name, arguments)
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = field(item, "call_id", str, None, f"{where}.")
            if not call_id:
                raise ApiError(400, f"'{where}.call_id' must name the function call it answers",
                               param=f"{where}.call_id")
            output = item.get("output")
            shown = _parts(output, f"{where}.output", settings) if isinstance(output, list) else \
                field(item, "output", str, "", f"{where}.")
            tool = {"role": "tool", "tool_call_id": call_id, "content": shown}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        elif kind == "additional_tools":
            for j, tool in enumerate(field(item, "tools", list, [], f"{where}.")):
                toolbox.add(tool, f"{where}.tools[{j}]")
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: templates drop it too
        elif kind in _HOSTED_ITEMS:
            if dropped is not None:
                dropped.append(kind)
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
            raise bodies.image_refused(f"{where}[{j}]", _MEDIA[kind], settings)
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


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Choice:
    """``tool_choice``: auto, none, required, a function by name, or ``allowed_tools`` (a subset, auto or
    required); a name must be one of ``tools``."""
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in ("auto", "none", "required")):
        return Choice(choice or "auto")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return Choice("required", checked_names([choice.get("name")], tools, "tool_choice.name"))
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and isinstance(choice.get("tools"), list):
        names = [t.get("name") if isinstance(t, dict) else None for t in choice["tools"]]
        return Choice(choice["mode"], checked_names(names, tools, "tool_choice.tools"))
    raise ApiError(400, "'tool_choice' must be auto, none, required, {\"type\": \"function\", \"name\": ...} or "
                        "{\"type\": \"allowed_tools\", ...}", param="tool_choice")


def _strict(body: dict[str, Any]) -> set[str]:
    """The function tools whose arguments must validate against their schema (``strict: true``, said)."""
    given = body.get("tools")
    tools: list[Any] = given if isinstance(given, list) else []
    return {t["name"] for t in tools
            if isinstance(t, dict) and t.get("strict") is True and isinstance(t.get("name"), str)}


def _kind(block: Any, default: str | None = None) -> str | None:
    """A block's ``type`` when it is a string (anything else matches no type)."""
    kind = block.get("type", default) if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None
