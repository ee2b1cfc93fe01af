"""Each model's tool-call format as grammar rules: how a call of each offered tool is written after its marker.

A model writes tool calls as its chat template shows them, and mlx-lm reads them back with the tool parser it picks
from that template (``mlx_lm.tool_parsers``): hermes-style JSON in ``<tool_call>`` tags (``json_tools``), Qwen3-Coder's
``<function=...><parameter=...>`` (``qwen3_coder``), GLM's ``<arg_key>``/``<arg_value>`` (``glm47``, ``longcat``),
MiniMax's ``<invoke>`` (``minimax_m2``), Kimi K2's tool-call sections (``kimi_k2``), Mistral's ``[TOOL_CALLS]``
(``mistral``) and LFM2's Python calls (``pythonic``). For each, a ``Format`` writes the rules whose every sentence
that parser reads as calls of the offered tools, their arguments valid against each tool's schema: JSON arguments
by llguidance's JSON-schema compiler, a raw parameter value (a string the parser keeps as written) by a regular
expression of its schema. A schema a format cannot hold raises ``Inexpressible``; ``loosened`` makes a tool that is
not strict fit anyway (any arguments that still parse). The whole reply's grammar is ``tool_grammar``'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.tools import Tool, ToolCalls
from mlxpipe.worker.generation.lark_writer import Lark, Markers, regex

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# What a string schema may say that a raw value's regular expression holds (``format`` is an annotation, as
# JSON-schema validators treat it by default).
_STRING_KEYS = {"type", "enum", "const", "pattern", "minLength", "maxLength", "format", "description", "title",
                "default", "examples"}
_NOTES = {"description", "title", "default", "examples"}
NL = "\n"


class Inexpressible(ValueError):
    """A tool's schema that the model's tool-call format cannot hold; ``tool`` names it."""

    def __init__(self, tool: str, message: str) -> None:
        super().__init__(message)
        self.tool = tool


def format_of(tokenizer: TokenizerWrapper) -> str | None:
    """The tool-call format of mlx-lm's tokenizer: its tool parser's module (``json_tools``...), None without one.
    A model whose response format routes its own tool calls (gpt-oss's channels) has none here either."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    targets = {dst for edges in (getattr(tokenizer, "response_transitions", None) or {}).values() for _, dst in edges}
    if "tool" in targets:
        return None
    return str(getattr(parser, "__module__", "")).rsplit(".", 1)[-1] or None


# --- a tool's parameters, as raw values -------------------------------------------------


def _object(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as an object's schema (templates and parsers take arguments as an object)."""
    return schema if "type" in schema else {**schema, "type": "object"}


def _properties(tool: Tool) -> list[tuple[str, dict[str, Any], bool]]:
    """A tool's parameters, in its schema's order: (name, schema, required)."""
    schema = tool.parameters
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise Inexpressible(tool.name, f"the parameters of {tool.name!r} need 'properties' as an object")
    missing = [r for r in required if r not in props]
    if missing:
        raise Inexpressible(tool.name, f"{tool.name!r} requires {missing[0]!r}, which its 'properties' lack")
    return [(name, s if isinstance(s, dict) else {}, name in required) for name, s in props.items()]


def _anywhere(text: str) -> str:
    """A regular expression of any text holding ``text``."""
    return regex(f"(?s:.*){re.escape(text)}(?s:.*)")


def _pattern(pattern: str) -> str:
    """A JSON-schema ``pattern`` (found anywhere in the value, unless anchored) as a whole-value expression."""
    head = pattern[1:] if pattern.startswith("^") else "(?s:.*)" + pattern
    tail = head[:-1] if head.endswith("$") and not head.endswith("\\$") else head + "(?s:.*)"
    return regex(f"(?:{tail})" if pattern.startswith("^") else tail)


@dataclass(frozen=True)
class RawValues:
    """How a format writes a parameter's value as raw text, and how its parser reads it back."""

    forbid: tuple[str, ...]  # the closing tags a value may not hold (its parser cuts at them)
    strip: bool  # the parser strips the value (so a string may not start or end with white space)
    null_text: bool  # the parser reads "null" (any case) as None
    string_if: Callable[[dict[str, Any]], str | None]  # "raw", "json" or None: how the parser reads this schema


def raw_value(g: Lark, tool: str, name: str, schema: dict[str, Any], raw: RawValues) -> str:
    """The grammar of one parameter's value in a raw-value format."""
    if not {k for k in schema if k not in _NOTES}:
        return g.terminal(_raw_text(raw, None))  # {}: any value (a loosened parameter)
    kind = raw.string_if(schema)
    if kind == "json":
        return g.json(schema)
    if kind != "raw" or set(schema) - _STRING_KEYS:
        raise Inexpressible(tool, f"the parameter {name!r} of {tool!r} has a schema this model's tool-call "
                                  "format cannot hold as a grammar")
    choices = schema["enum"] if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if choices is not None:
        if not choices or not all(isinstance(c, str) and _writable(c, raw) for c in choices):
            raise Inexpressible(tool, f"the parameter {name!r} of {tool!r} has values this format cannot write")
        return g.rule(" | ".join(g.lit(c) for c in choices))
    return g.terminal(_raw_text(raw, schema))


def _writable(value: str, raw: RawValues) -> bool:
    return (not any(f in value for f in raw.forbid) and not (raw.strip and value != value.strip())
            and not (raw.null_text and value.lower() == "null"))


def _raw_text(raw: RawValues, schema: dict[str, Any] | None) -> str:
    """A terminal of the raw strings ``schema`` allows (None: any) that the parser reads back as written."""
    lo = (schema or {}).get("minLength", 0)
    hi = (schema or {}).get("maxLength")
    parts = [regex(f"(?s:.{{{lo},{'' if hi is None else hi}}})")]
    if schema and isinstance(schema.get("pattern"), str):
        parts.append(_pattern(schema["pattern"]))
    parts += [f"~{_anywhere(f)}" for f in raw.forbid]
    if raw.strip:
        parts.append(regex(r"(\S((?s:.*)\S)?)?"))
    if raw.null_text and schema is not None:  # "null" reads back as None, which a string schema does not allow
        parts.append("~/(?i:null)/")
    return " & ".join(parts)


# --- the formats --------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """One tool-call format: how a call is written after its opening marker, and what separates calls.

    ``sections``: each call is its own marked section (``<tool_call>...</tool_call>``), several in a row separated
    by ``between``; otherwise one section holds every call, separated by ``within``.
    """

    name: str
    call: Callable[[Lark, Tool], str]  # one call's text (inside its section)
    sections: bool = True
    between: str = ""
    within: str = ""
    head: str = ""  # what follows the opening marker before the first call
    tail: str = ""  # what precedes the closing marker after the last call

    def after_start(self, g: Lark, tools: tuple[Tool, ...], parallel: bool) -> str:
        """Everything after a section's opening marker, up to and with its closing marker."""
        one = g.rule(" | ".join(self.call(g, t) for t in tools))
        calls = one if self.sections or not parallel else f"{one} ({g.lit(self.within)} {one})*"
        return f"{g.lit(self.head)} {calls} {g.lit(self.tail)} {g.lit(g.markers.end)}"


def _json_tools(g: Lark, tool: Tool) -> str:
    # {"name": "get_weather", "arguments": {...}}: as hermes/Qwen templates write it
    name = g.lit(json.dumps(tool.name, ensure_ascii=False))
    return f'"{{\\"name\\": " {name} ", \\"arguments\\": " {g.json(_object(tool.parameters))} "}}"'


def _qwen3_kind(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if not isinstance(kind, str):
        return None
    kind = kind.strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return "raw"
    # As its parser converts them: numbers, booleans, objects and arrays from their JSON text.
    if kind.startswith(("int", "uint", "long", "short", "unsigned", "num", "float", "bool", "binary", "dict",
                        "list")) or kind in ("object", "array", "arr", "null"):
        return "json"
    return None


_QWEN3_VALUES = RawValues(forbid=("</parameter>",), strip=False, null_text=True, string_if=_qwen3_kind)


def _qwen3_coder(g: Lark, tool: Tool) -> str:
    # <function=name>\n<parameter=p>\nvalue\n</parameter>\n...</function>: Qwen3-Coder's template
    params = []
    for name, schema, required in _properties(tool):
        value = raw_value(g, tool.name, name, schema, _QWEN3_VALUES)
        params.append((f"{g.lit(f'<parameter={name}>' + NL)} {value} {g.lit(NL + '</parameter>' + NL)}", not required))
    return f"{g.lit(NL + f'<function={tool.name}>' + NL)} {g.joined(params, '')} {g.lit('</function>' + NL)}"


def _glm_kind(schema: dict[str, Any]) -> str | None:
    return "raw" if schema.get("type") == "string" else "json"


def _glm(key: str, value: str, bare_name: bool = True) -> Callable[[Lark, Tool], str]:
    values = RawValues(forbid=(f"</{value}>",), strip=True, null_text=False, string_if=_glm_kind)

    def call(g: Lark, tool: Tool) -> str:
        # name<arg_key>p</arg_key><arg_value>v</arg_value>...: GLM-4.7's template (4.5's newlines between are allowed)
        params = [(f'"\\n"? {g.lit(f"<{key}>{n}</{key}>")} "\\n"? {g.lit(f"<{value}>")} '
                   f'{raw_value(g, tool.name, n, s, values)} {g.lit(f"</{value}>")}', not req)
                  for n, s, req in _properties(tool)]
        if not params and not bare_name:  # LongCat's parser needs a key to find the name: its JSON form then
            return _json_tools(g, tool)
        return f'{g.lit(tool.name)} {g.joined(params, "")} "\\n"?'
    return call


def _minimax_kind(schema: dict[str, Any]) -> str | None:
    from mlx_lm.tool_parsers.minimax_m2 import _extract_types_from_schema

    types = set(_extract_types_from_schema(schema))
    if "string" not in types:
        return "json"
    given = schema.get("type", "string")
    given = {given} if isinstance(given, str) else set(given) if isinstance(given, list) else {"?"}
    return "raw" if types <= {"string", "null"} and given <= {"string", "null"} else None


_MINIMAX_VALUES = RawValues(forbid=("</parameter>", "</invoke>"), strip=True, null_text=True,
                            string_if=_minimax_kind)


def _minimax(g: Lark, tool: Tool) -> str:
    # <invoke name="f">\n<parameter name="p">v</parameter>\n...</invoke>\n: MiniMax-M2's template
    params = []
    for name, schema, required in _properties(tool):
        value = raw_value(g, tool.name, name, schema, _MINIMAX_VALUES)
        params.append((f"{g.lit(f'<parameter name={json.dumps(name)}>')} {value} {g.lit('</parameter>' + NL)}",
                       not required))
    return f"{g.lit(f'<invoke name={json.dumps(tool.name)}>' + NL)} {g.joined(params, '')} {g.lit('</invoke>' + NL)}"


def _kimi(g: Lark, tool: Tool) -> str:
    # <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>: Kimi K2's template
    return (f'{g.lit("<|tool_call_begin|>")} {g.lit(f"functions.{tool.name}:")} /0|[1-9][0-9]{{0,2}}/ '
            f'{g.lit("<|tool_call_argument_begin|>")} {g.json(_object(tool.parameters))} {g.lit("<|tool_call_end|>")}')


def _mistral_json(g: Lark, tool: Tool) -> str:
    # [TOOL_CALLS][{"name": "f", "arguments": {...}}]: Mistral's older templates
    return _json_tools(g, tool)


def _mistral_args(g: Lark, tool: Tool) -> str:
    # [TOOL_CALLS]f[ARGS]{...}: Mistral's newer templates, one marker per call
    return f'{g.lit(tool.name)} {g.lit("[ARGS]")} {g.json(_object(tool.parameters))}'


def _pythonic(g: Lark, tool: Tool) -> str:
    # [f(p="x", q=2)]: LFM2's template; JSON values are Python literals to its parser (true/false/null too)
    params = [(f'{g.lit(f"{n}=")} {g.json(s or {})}', not req) for n, s, req in _properties(tool)]
    return f'{g.lit(f"{tool.name}(")} {g.joined(params, ", ")} ")"'


FORMATS: dict[str, Format] = {
    "json_tools": Format("json_tools", _json_tools, head="\n", tail="\n", between="\n"),
    "qwen3_coder": Format("qwen3_coder", _qwen3_coder, between="\n"),
    "glm47": Format("glm47", _glm("arg_key", "arg_value"), between="\n"),
    "longcat": Format("longcat", _glm("longcat_arg_key", "longcat_arg_value", bare_name=False), between="\n"),
    "minimax_m2": Format("minimax_m2", _minimax, sections=False, head="\n"),
    "kimi_k2": Format("kimi_k2", _kimi, sections=False),
    "mistral_json": Format("mistral_json", _mistral_json, sections=False, head="[", tail="]", within=", "),
    "mistral_args": Format("mistral_args", _mistral_args),
    "pythonic": Format("pythonic", _pythonic, sections=False, head="[", tail="]", within=", "),
}
SUPPORTED = ("json_tools", "qwen3_coder", "glm47", "longcat", "minimax_m2", "kimi_k2", "mistral", "pythonic")


def resolve(name: str, markers: Markers) -> Format | None:
    """The format of mlx-lm's parser ``name`` for this tokenizer (Mistral's by its template), None when no grammar
    here writes it."""
    if name == "mistral":
        name = "mistral_args" if markers.args_header else "mistral_json"
    return FORMATS.get(name)


def loosened(calls: ToolCalls, tool: str) -> ToolCalls:
    """``calls`` with ``tool``'s schema made one its format can hold: any arguments that still parse (for a tool
    that is not strict, where the exact schema cannot be held)."""
    fmt = calls.format
    out = []
    for t in calls.tools:
        if t.name != tool:
            out.append(t)
        elif fmt in ("qwen3_coder", "glm47", "longcat", "minimax_m2"):
            out.append(replace(t, parameters=_raw_loose(t.parameters)))
        else:
            out.append(replace(t, parameters={"type": "object"}))
    return replace(calls, tools=tuple(out))


def _raw_loose(schema: dict[str, Any]) -> dict[str, Any]:
    """A raw-value format's loosest schema: the same parameters, each any value ({})."""
    given = schema.get("properties")
    props: dict[str, Any] = given if isinstance(given, dict) else {}
    required = [r for r in (schema.get("required") or []) if r in props]
    return {"type": "object", "properties": {name: {} for name in props}, "required": required}
