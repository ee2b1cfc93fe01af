"""What a body asks of its reply's tool calls (``tool_choice``, ``parallel_tool_calls``, strict tools), held by the
grammar engine: the ``ToolCalls`` rank 0 builds the grammar of, checked here first, door-neutral.

Every door with tools reads its own spelling into a ``Choice`` and calls ``enforce``:

- ``required`` (Anthropic's ``any``) or a named tool: the reply is calls from its first token, in the model's own
  tool-call format, to the offered tools (that one tool) only; ``parallel`` false: exactly one.
- ``auto`` (or none given): free text, but a call the model starts is completed under the grammar, so none comes
  out half-formed; ``parallel`` false: at most one.
- a strict tool (``strict: true``): its arguments must validate against its schema, so a schema the format cannot
  hold is a 400 naming it; a tool that is not strict and cannot be held exactly is loosened (any arguments that
  still parse), with one warning line in the server's output naming it.

A model whose tool-call format no grammar here writes (``worker.generation.tool_formats.SUPPORTED``), or a server
with a draft model (whose sampling no grammar reaches), refuses what must be enforced (``required``, a named tool, a
strict tool) with a 400 naming the field, and leaves ``auto`` as the model writes it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxpipe import console
from mlxpipe.protocol.request import Request
from mlxpipe.protocol.tools import Tool, ToolCalls
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.worker.generation.constraints import tool_compile_error
from mlxpipe.worker.generation.lark_writer import Markers
from mlxpipe.worker.generation.tool_formats import SUPPORTED, format_of, loosened, resolve

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

_FORMATS = ", ".join(SUPPORTED)


@dataclass(frozen=True)
class Choice:
    """A body's ``tool_choice``, whatever its door's spelling."""

    mode: str = "auto"  # "auto", "none" or "required"
    names: tuple[str, ...] | None = None  # the tools it may call (a named tool, OpenAI's allowed_tools); None: all
    field: str = "tool_choice"  # the body's name for it, in errors

    @property
    def named(self) -> str | None:
        """The one tool a named choice calls."""
        return self.names[0] if self.mode == "required" and self.names and len(self.names) == 1 else None

    def template_value(self) -> Any:
        """What the chat template's ``tool_choice`` variable gets (None: nothing; templates that know it know
        OpenAI's words)."""
        if self.mode == "auto":
            return None
        if self.named is not None:
            return {"type": "function", "function": {"name": self.named}}
        return self.mode


def functions(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The function tools among ``tools`` (the template's shape), as their ``function`` objects."""
    return [t["function"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)]


def checked_names(names: list[Any], tools: list[Any] | None, param: str) -> tuple[str, ...]:
    """Tool names a choice gives, each one of ``tools`` (a 400 naming ``param`` otherwise)."""
    offered = {f["name"] for f in functions(tools)}
    for name in names:
        if not isinstance(name, str) or name not in offered:
            raise ApiError(400, f"'{param}' must name one of 'tools', got {str(name)[:60]!r}", param=param)
    return tuple(names)


def enforce(request: Request, tools: list[Any] | None, choice: Choice, parallel: bool,
            strict: Collection[str], tokenizer: TokenizerWrapper, settings: ServerSettings) -> Request:
    """``request`` (as the ranks run it: its prompt as tokens) with the tool calls its reply is held to; unchanged
    when there is nothing to hold (no tools, ``none``, or ``auto`` where no grammar can). Raises ``ApiError``."""
    if not tools or choice.mode == "none":
        return request
    must = choice.mode == "required" or bool(strict)
    why = _cannot(request, tokenizer, settings)
    if why is not None:
        if must:
            param = choice.field if choice.mode == "required" else "tools"
            raise ApiError(400, f"'{param}' cannot be enforced: {why}", param=param)
        return request  # auto: the calls are the model's alone, as without a grammar
    wanted = set(choice.names) if choice.names is not None else None
    offered = [f for f in functions(tools) if wanted is None or f["name"] in wanted]
    if not offered:
        if choice.mode == "required":
            raise ApiError(400, f"'{choice.field}' asks for a tool call, but no function tool is offered",
                           param=choice.field)
        return request
    calls = ToolCalls(str(format_of(tokenizer)), tuple(Tool(f["name"], _parameters(f)) for f in offered),
                      required=choice.mode == "required", parallel=parallel)
    return replace(request, tool_calls=_held(calls, strict, tokenizer, list(request.tokens or ()), choice, must))


def _cannot(request: Request, tokenizer: TokenizerWrapper, settings: ServerSettings) -> str | None:
    """Why no grammar can hold this request's tool calls, or None."""
    if settings.draft_model:
        return "this server runs a draft model (--draft-model), whose sampling no grammar reaches; serve without one"
    if request.response_format is not None:
        return "the reply is held to 'response_format' already"
    fmt = format_of(tokenizer)
    if fmt is None:
        return "this model's chat template names no tool-call format mlx-lm can parse"
    if resolve(fmt, Markers.of(tokenizer)) is None:
        return (f"this model writes tool calls as mlx-lm's {fmt!r} parser reads them, which mlxpipe cannot write "
                f"as a grammar yet (it can: {_FORMATS})")
    return None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def _held(calls: ToolCalls, strict: Collection[str], tokenizer: TokenizerWrapper, prompt: list[int],
          choice: Choice, must: bool) -> ToolCalls | None:
    """``calls`` once its grammar compiles: a tool that is not strict and that the format cannot hold exactly is
    loosened; a strict one is a 400. A grammar that cannot compile as a whole is a 400 where the body ``must``
    be held, and nothing held under ``auto`` (the calls are then the model's alone, as without a grammar)."""
    for _ in range(len(calls.tools) + 1):
        error = tool_compile_error(calls, tokenizer, prompt)
        if error is None:
            return calls
        tool, reason = error
        if tool is None:
            if not must:
                return None
            raise ApiError(400, f"'{choice.field}' cannot be enforced: {reason[:300]}", param=choice.field)
        if tool in strict:
            raise ApiError(400, f"'tools': the tool {tool!r} is strict, but its parameters cannot be held to its "
                                f"schema in this model's tool-call format: {reason[:300]}", param="tools",
                           code="invalid_function_parameters")
        # The request goes on (the tool is not strict), but whoever runs the server can see why its calls may not
        # validate.
        console.warn(f"tools: the tool {tool!r}'s arguments are held to parse, not to its schema: {reason[:200]}")
        calls = loosened(calls, tool)
    if not must:
        return None
    raise ApiError(400, f"'{choice.field}' cannot be enforced", param=choice.field)
