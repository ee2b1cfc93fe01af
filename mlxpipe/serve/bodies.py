"""What every door's body checks share: typed fields, sampling options over the server's, the model's name, chat
messages for the template (tool calls and results as ``mlx_lm.server`` gives them to it, system turns wherever
they come), the thinking switch, the prompt's tokens, the context, and what a server with a draft model refuses.

Each door names the fields its own way (``messages[2].content[0]``, ``input[1].output``); every error here is an
``ApiError`` naming that field, raised before anything reaches a rank. What a body asks that a local server cannot
honour (a hosted tool, a reply longer than the context leaves) is dropped or mapped instead, and said in the
request's ``Notes``: one line in the server's output with the request's own.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, overload

from mlxpipe.errors import UsageError
from mlxpipe.prompts import prompt_tokens
from mlxpipe.protocol.request import Image, Request, RequestError, parse_logit_bias
from mlxpipe.serve.door import ApiError, ContextTooLong, ServerSettings
from mlxpipe.worker.generation.constraints import compile_error

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

MAX_TOOLS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000  # characters of one stop string

_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "an object",
               str: "a string"}


T = TypeVar("T")


@overload
def field(body: dict[str, Any], name: str, kinds: type[T], default: T, where: str = "") -> T: ...
@overload
def field(body: dict[str, Any], name: str, kinds: type[T], default: None = None, where: str = "") -> T | None: ...
@overload
def field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None, where: str = "") -> Any: ...
def field(body: dict[str, Any], name: str, kinds: Any, default: Any = None, where: str = "") -> Any:
    """``body[name]`` checked against ``kinds`` (bools are not numbers), or ``default`` when absent or null;
    ``where`` prefixes the name in the error (``messages[0].``)."""
    value = body.get(name)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = " or ".join(_KIND_NAMES[t] for t in allowed)
        raise ApiError(400, f"'{where}{name}' must be {names}, got {json.dumps(value)[:60]}", param=f"{where}{name}")
    return value


# What a body asked that this server dropped or mapped ("max_tokens 64000 -> 3000: what the context leaves"):
# said with the request's line in the server's output and its record in the request log.
Notes = list[str]


def check_model(body: dict[str, Any], settings: ServerSettings) -> str:
    """The name the body calls the model (replies echo it; ``--model``'s value when it names none). A name this
    server does not answer to (``ServerSettings.answers_to``) is a 404, as OpenAI's API answers it."""
    model = body.get("model")
    if model is None:
        return settings.model_id
    if not isinstance(model, str) or not settings.answers_to(model):
        raise ApiError(404, f"the model {str(model)[:80]!r} does not exist; this server serves "
                            f"{settings.model_id!r} (--served-model-name adds names, --any-model-name takes any)",
                       param="model", code="model_not_found")
    return model


# OpenAI's reasoning efforts (chat's ``reasoning_effort``, the Responses API's ``reasoning.effort``): the
# template's thinking switch has two positions, so every effort but ``none`` turns it on.
EFFORT_THINKS = {"none": False, "minimal": True, "low": True, "medium": True, "high": True, "xhigh": True}


def effort_switch(effort: str | None, name: str, notes: Notes) -> bool | None:
    """An OpenAI reasoning ``effort`` (the body's field ``name``) as the template's thinking switch, said in
    ``notes``; None when the body gives none, a 400 naming ``name`` for an effort OpenAI does not have."""
    if effort is None:
        return None
    if effort not in EFFORT_THINKS:
        raise ApiError(400, f"'{name}' must be one of {', '.join(EFFORT_THINKS)}", param=name)
    notes.append(f"{name} {effort} -> the template's thinking switch {'on' if EFFORT_THINKS[effort] else 'off'}")
    return EFFORT_THINKS[effort]


def thinking(request: Request, body: dict[str, Any], enabled: bool | None) -> Request:
    """``request`` with the chat template's thinking switch set from the body's own field (Anthropic's ``thinking``,
    the Responses API's ``reasoning``, chat's ``reasoning_effort``; None: the body says nothing). mlx-lm's
    ``TokenizerWrapper`` passes ``enable_thinking`` to the template under the name it takes (``thinking`` for some)
    and turns it on by default where the model has think tokens; a body's ``chat_template_kwargs`` that sets it
    wins."""
    if enabled is None:
        return request
    given = body.get("chat_template_kwargs")
    if isinstance(given, dict) and ("enable_thinking" in given or "thinking" in given):
        return request
    return replace(request, chat_template_config={**(request.chat_template_config or {}), "enable_thinking": enabled})


def json_types(annotation: Any) -> Any:
    """The JSON values a ``Request`` field takes: a float field takes integers too."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = [typing.get_origin(a) or a for a in args if a is not type(None)]
    if kinds == [float]:
        return (int, float)
    (kind,) = kinds
    return kind


HINTS = typing.get_type_hints(Request)


def options(body: dict[str, Any], settings: ServerSettings, names: Mapping[str, str]) -> Request:
    """The body's options (``names``: body field -> ``Request`` field, checked in that order; a later name of
    the same field wins) over the server's defaults, checked; errors name the body's field. A ``logit_bias``
    takes token ids as strings (JSON's keys), a ``response_format`` is compiled (``check_schema``)."""
    values: dict[str, Any] = {}
    spelled = {key: name for name, key in names.items()}
    for name, key in names.items():
        value = field(body, name, json_types(HINTS[key]))
        if value is not None:
            values[key], spelled[key] = value, name
    try:
        if "logit_bias" in values:
            values["logit_bias"] = parse_logit_bias(values["logit_bias"], f"'{spelled['logit_bias']}'")
        request = replace(settings.defaults, **values).check(lambda key: f"'{spelled.get(key, key)}'",
                                                             settings.vocab_size)
    except RequestError as e:
        raise ApiError(400, e.message, param=spelled.get(e.field, e.field)) from None
    if "response_format" in values and request.response_format is not None:
        check_schema(request.response_format, spelled["response_format"])
    return request


def stops(body: dict[str, Any], name: str) -> list[str]:
    """``body[name]``: a list of stop strings (a single string too), bounded."""
    value = body.get(name)
    if value is None:
        return []
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not all(isinstance(s, str) for s in found):
        raise ApiError(400, f"'{name}' must be a string or a list of strings", param=name)
    if len(found) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in found):
        raise ApiError(400, f"'{name}' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                            "characters", param=name)
    return [s for s in found if s]


def tool_list(body: dict[str, Any], convert: Callable[[Any, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The body's ``tools``, at most ``MAX_TOOLS`` once ``convert(tool, where)`` has turned each into the
    template's shape (none for a tool left out, several for a group of them; it raises ``ApiError`` naming
    ``tools[i]``); empty when absent."""
    tools = field(body, "tools", list) or []
    out = [t for i, tool in enumerate(tools) for t in convert(tool, f"tools[{i}]")]
    if len(out) > MAX_TOOLS:
        raise ApiError(400, f"'tools' takes at most {MAX_TOOLS} tools, got {len(out)}", param="tools")
    return out


# The APIs' built-in tools, by their type or its start (Anthropic's carry a date: web_search_20250305): those their
# own servers run (searching the web, running code, a remote MCP server...) and those whose schema only their own
# models know (a shell, a text editor, a computer). This server runs none and has no schema to give the model for
# them, so they are left out of the prompt and named in the request's notes.
BUILT_IN_TOOLS = ("web_search", "web_fetch", "file_search", "code_interpreter", "code_execution", "computer",
                "image_generation", "mcp", "tool_search", "local_shell", "shell", "apply_patch", "bash",
                "text_editor", "memory")


def built_in(kind: str | None) -> bool:
    """``kind`` is one of the APIs' built-in tool types (``BUILT_IN_TOOLS``)."""
    return kind is not None and any(kind == h or kind.startswith(f"{h}_") for h in BUILT_IN_TOOLS)


def left_out(notes: Notes, kinds: list[str]) -> None:
    """The built-in tools a body offered, named once in ``notes``."""
    if kinds:
        notes.append(f"built-in tools left out (only function tools reach the model): {', '.join(sorted(set(kinds)))}")


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A tool as chat templates (and mlx-lm's tool parsers) read it: OpenAI's function tool."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"'{where}.name' must be a non-empty string", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"'{where}.description' must be a string", param=f"{where}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(400, f"'{where}' needs its parameters' JSON schema as an object", param=where)
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An assistant message's tool call for the chat template: arguments as an object, as ``mlx_lm.server`` gives
    them (templates write them with ``tojson``)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def image_refused(where: str, what: str, settings: ServerSettings | None = None) -> ApiError:
    """Images, documents and files (``what``: "an image"...): text-only for now, and said so; an image to a
    vision-language model that this install cannot run (no mlx-vlm) names the extra to install."""
    if what == "an image" and settings is not None and settings.vision_missing:
        return no_images(where, settings)
    return ApiError(400, f"'{where}' is {what}: this server takes text only (no images, documents or "
                         "files yet); send the text instead", param=where)


def no_images(where: str, settings: ServerSettings) -> ApiError:
    """The 400 for an image to a server whose model takes none: a text-only model, or a vision-language model
    served by an install without the vision extra (which the message names)."""
    if settings.vision_missing:
        from mlxpipe.vision.prompt import NEEDS_VISION, VISION_HINT

        return ApiError(400, f"'{where}' is an image: {NEEDS_VISION} (on the server: {VISION_HINT})", param=where,
                        code="invalid_image")
    return ApiError(400, f"'{where}' is an image: this server's model takes no images (a text-only model)",
                    param=where, code="invalid_image")


def image_from_uri(uri: Any, where: str, settings: ServerSettings) -> Image:
    """An image a body sends as a URI (a ``data:`` URI; ``http(s)`` only where the server allows it), checked
    against the server's limits; a bad one is a 400 naming ``where``, the message and part."""
    from mlxpipe.vision.images import ImageError, from_data_uri

    if not isinstance(uri, str) or not uri:
        raise ApiError(400, f"'{where}' must be an image URL (a data: URI)", param=where)
    if settings.vision is None:  # before the URL is looked at: no flag makes a text-only model see it
        raise no_images(where, settings)
    try:
        return from_data_uri(uri, settings.image_limits)
    except ImageError as e:
        raise ApiError(400, f"'{where}': {e.message}", param=where, code="invalid_image") from None


def image_from_base64(source: Any, where: str, settings: ServerSettings) -> Image:
    """An image a body sends as base64 text, checked against the server's limits; a 400 naming ``where``."""
    from mlxpipe.vision.images import ImageError, check_image, decode_base64

    if not isinstance(source, str) or not source:
        raise ApiError(400, f"'{where}' must be the image's base64 data", param=where)
    try:
        return check_image(decode_base64(source), settings.image_limits)
    except ImageError as e:
        raise ApiError(400, f"'{where}': {e.message}", param=where, code="invalid_image") from None


def with_images(request: Request, images: list[tuple[Image, str]], settings: ServerSettings, param: str,
                tools: list[Any] | None = None) -> Request:
    """``request`` (its messages, each image a ``{"type": "image"}`` part) with ``images`` (each with the field
    it came from), tokenized by the model's processor, ``tools`` listed by its template; a model that takes none,
    or too many images, is a 400."""
    if not images:
        return request
    first = images[0][1]
    if settings.vision is None:
        raise no_images(first, settings)
    limit = settings.image_limits.max_images
    if len(images) > limit:
        where = images[limit][1]
        raise ApiError(400, f"'{where}': a request may hold at most {limit} images", param=where,
                       code="invalid_image")
    request = replace(request, images=tuple(image for image, _ in images))
    try:
        return settings.vision.tokenize(request, tools)
    except UsageError as e:
        raise ApiError(400, e.message, param=param) from None
    except Exception as e:  # noqa: BLE001 - the processor or its chat template rejects these messages
        raise ApiError(400, f"the image processor rejected '{param}': {e}", param=param) from None


def tokens_and_images(tokenizer: TokenizerWrapper, prompt: Request, images: list[tuple[Image, str]],
                      tools: list[Any] | None, extra: dict[str, Any] | None, param: str, settings: ServerSettings,
                      notes: Notes) -> tuple[list[int], tuple[Image, ...], str | None]:
    """The prompt's token ids, with the images that go with them and the text the image processor expanded
    (``Request.images``, ``Request.vision_prompt``): through the model's processor when the messages hold images
    (``with_images``: mlx-vlm's chat template, given the tools and template variables as mlx-vlm's server gives
    them), else through the chat template (``tokens_for``)."""
    if not images:
        return tokens_for(tokenizer, prompt, tools, extra, param, notes), (), None
    if extra:
        prompt = replace(prompt, chat_template_config={**(prompt.chat_template_config or {}), **extra})
    vision = with_images(prompt, images, settings, param, tools)
    assert vision.tokens is not None  # with_images tokenizes
    return vision.tokens, vision.images, vision.vision_prompt


def tokens_for(tokenizer: TokenizerWrapper, request: Request, tools: list[Any] | None, extra: dict[str, Any] | None,
               param: str, notes: Notes | None = None) -> list[int]:
    """The prompt's token ids through the chat template (``extra``: more template variables, such as
    ``tool_choice``); a template that refuses the messages is a 400 naming ``param``.

    System turns stay where the conversation has them (agents send one mid-conversation) when the template takes
    them there; a template that refuses them, or leaves one out, gets them merged into one system turn first
    (said in ``notes``).
    """
    if extra:
        request = replace(request, chat_template_config={**(request.chat_template_config or {}), **extra})
    messages = request.messages or []
    systems = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if systems in ([], [0]):
        return _tokens(tokenizer, request, tools, param)
    try:
        tokens = _tokens(tokenizer, request, tools, param)
        shown = tokenizer.decode(tokens, clean_up_tokenization_spaces=False)  # the text as the template wrote it
        if all(_text(messages[i]).strip() in shown for i in systems):
            return tokens
    except ApiError:
        pass
    if notes is not None:
        notes.append(f"{len(systems)} system turns merged into the first: the chat template takes one")
    return _tokens(tokenizer, replace(request, messages=merge_system(messages)), tools, param)


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every system turn's text joined (in order) into one system turn at the start."""
    systems = [_text(m) for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(t for t in systems if t)}, *rest]


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _tokens(tokenizer: TokenizerWrapper, request: Request, tools: list[Any] | None, param: str) -> list[int]:
    try:
        tokens = prompt_tokens(tokenizer, request, tools)
    except UsageError as e:
        raise ApiError(400, e.message, param=param) from None
    except Exception as e:  # noqa: BLE001 - a chat template that rejects these messages
        raise ApiError(400, f"the chat template rejected '{param}': {e}", param=param) from None
    if not tokens:
        raise ApiError(400, "the prompt has no tokens", param=param)
    return tokens


# What speculative decoding cannot do: it samples inside mlx-lm, where neither a grammar mask nor logprobs reach.
DRAFT_REFUSES = ("response_format", "logprobs")


def for_ranks(request: Request, tokens: list[int], settings: ServerSettings, param: str, new_id: Callable[[], str],
              spelled: Mapping[str, str] | None = None, notes: Notes | None = None) -> Request:
    """The request as the ranks run it: the prompt within the context (``param``: the body's field for it; a
    longer one is ``ContextTooLong``), the reply bounded by what is left of it (said in ``notes`` when that
    shortens it), nothing a draft model cannot do (``spelled``: the body's name of a ``Request`` field where it
    differs)."""
    if len(tokens) + 1 > settings.context:
        raise ContextTooLong(len(tokens), settings.context, param)
    if settings.draft_model:
        refuse_with_draft(request, spelled or {})
    max_tokens = min(request.max_tokens, settings.context - len(tokens))
    if max_tokens < request.max_tokens and notes is not None:
        name = (spelled or {}).get("max_tokens", "max_tokens")
        notes.append(f"{name} {request.max_tokens} -> {max_tokens}: what the context ({settings.context}) leaves")
    # The ranks read token ids alone: the messages stay here.
    return replace(request, id=new_id(), tokens=tokens, max_tokens=max_tokens, messages=None, prompt=None,
                   prefill_response=None)


def refuse_with_draft(request: Request, spelled: Mapping[str, str]) -> None:
    """A 400 naming the body's field when ``request`` asks what a draft model cannot do (``DRAFT_REFUSES``)."""
    for key in DRAFT_REFUSES:
        if getattr(request, key):
            name = spelled.get(key, key)
            raise ApiError(400, f"'{name}' is not supported by this server: it runs a draft model (--draft-model); "
                                "serve without one for it", param=name)


def check_schema(response_format: dict[str, Any], param: str) -> None:
    """A schema llguidance cannot compile is a 400 naming it (``param``: the body's field), before anything
    reaches a rank."""
    error = compile_error(response_format)
    if error is None:
        return
    name = (response_format.get("json_schema") or {}).get("name")
    what = f"the schema {name!r}" if name else "the schema"
    raise ApiError(400, f"'{param}': {what} cannot be used for constrained decoding: {error[:300]}",
                   param=param, code="invalid_json_schema")
