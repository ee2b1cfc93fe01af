"""The grammar of a reply's tool calls, in the model's own tool-call format, for llguidance (``constraints``).

A model writes tool calls as its chat template shows them, and mlx-lm reads them back with the tool parser it picks
from that template (``mlx_lm.tool_parsers``): hermes-style JSON in ``<tool_call>`` tags (``json_tools``), Qwen3-Coder's
``<function=...><parameter=...>`` (``qwen3_coder``), GLM's ``<arg_key>``/``<arg_value>`` (``glm47``, ``longcat``),
MiniMax's ``<invoke>`` (``minimax_m2``), Kimi K2's tool-call sections (``kimi_k2``), Mistral's ``[TOOL_CALLS]``
(``mistral``) and LFM2's Python calls (``pythonic``). For each, this writes a Lark grammar (llguidance's syntax:
``%json`` for a JSON schema inline, ``<[id]>`` for a special token, ``[lazy]`` for a lexeme that ends at its first
match) whose every sentence that parser reads as calls of the offered tools, their arguments valid against each
tool's schema: JSON arguments by llguidance's JSON-schema compiler, a raw parameter value (a string the parser keeps
as written) by a regular expression of its schema. A schema a format cannot hold raises ``Inexpressible``;
``loosened`` makes a tool that is not strict fit anyway (any arguments that still parse).

Two shapes of reply: ``required`` is calls from the first token (after the model's reasoning, if it thinks), one
or, with ``parallel``, more; otherwise free text in which the grammar wakes at the call's opening marker
(a lazy lexeme, or the marker's special token) and completes that call, and every special token but the end of
sequence stays allowed, so only a call the model starts is held.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from mlxpipe.protocol.tools import Tool, ToolCalls

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# JSON as chat templates write it (``tojson``: ", " and ": "), as structured output writes it too.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Between the end of the model's reasoning and its first call; bounded, so a small model cannot wander there.
_GAP = r"/[ \t\r\n]{0,4}/"
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


# --- the model's markers ---------------------------------------------------------------


@dataclass(frozen=True)
class Markers:
    """What a grammar needs of the tokenizer: its tool-call and thinking markers, and its special tokens (which a
    grammar names by id: they are never text)."""

    start: str  # the call's opening marker (mlx-lm's tool_call_start)
    end: str  # its closing marker ("" for Mistral's: the calls run to the end)
    think: tuple[str, str] | None  # the reasoning block's markers, when the model thinks
    specials: dict[str, int]  # the text of each added token -> its id: llguidance reads them all as special
    ends: frozenset[int]  # the end-of-sequence tokens
    args_header: bool = False  # Mistral's template writes ``name[ARGS]{...}``, not a JSON list

    @classmethod
    def of(cls, tokenizer: TokenizerWrapper) -> Markers:
        """The markers of mlx-lm's ``TokenizerWrapper``."""
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        # Every added token, special or not (Qwen's <tool_call> is not): llguidance never reads one as text.
        specials = {t.content: i for i, t in getattr(hf, "added_tokens_decoder", {}).items()}
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
        template = getattr(hf, "chat_template", None)
        return cls(tokenizer.tool_call_start or "", tokenizer.tool_call_end or "", think, specials,
                   frozenset(tokenizer.eos_token_ids), isinstance(template, str) and "[ARGS]" in template)

    def lit(self, text: str) -> str:
        """``text`` in a grammar, as the tokenizer splits it: each added token in it by id (GLM's ``<arg_key>``,
        Kimi's ``<|tool_call_begin|>``: the model writes them as those tokens), the rest as strings."""
        if not text:
            return ""
        pieces = [p for p in self._added.split(text) if p] if self.specials else [text]
        return " ".join(f"<[{self.specials[p]}]>" if p in self.specials else json.dumps(p, ensure_ascii=False)
                        for p in pieces)

    @cached_property
    def _added(self) -> re.Pattern[str]:
        """The added tokens' texts, longest first, as a pattern that splits a text around them."""
        return re.compile("(" + "|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True)) + ")")

    def free_specials(self) -> list[int]:
        """The special tokens free text may hold: all but the ends of sequence and the call's opening marker."""
        return sorted(i for t, i in self.specials.items() if i not in self.ends and t != self.start)


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


def starts_in_reasoning(tokenizer: TokenizerWrapper, tokens: list[int]) -> bool:
    """Whether the reply starts inside the model's reasoning (the prompt opened a think block), as mlx-lm's server
    decides it."""
    if not getattr(tokenizer, "has_thinking", False) or not tokens:
        return False
    return bool(tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens))


# --- a Lark grammar, rule by rule --------------------------------------------------------


class Lark:
    """A grammar being written: named rules and terminals, and the markers to write them with."""

    def __init__(self, markers: Markers) -> None:
        self.markers = markers
        self.lines: list[str] = []
        self._names = 0

    def rule(self, body: str, lazy: bool = False) -> str:
        """A new rule of ``body``; its name."""
        self._names += 1
        name = f"r{self._names}"
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def terminal(self, body: str) -> str:
        """A new terminal (a lexeme: a regular expression, ``&`` and ``~`` allowed); its name."""
        self._names += 1
        name = f"T{self._names}"
        self.lines.append(f"{name}: {body}")
        return name

    def lit(self, text: str) -> str:
        return self.markers.lit(text)

    def json(self, schema: dict[str, Any]) -> str:
        """A JSON value of ``schema``, written as templates write JSON."""
        return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)

    def joined(self, items: list[tuple[str, bool]], separator: str) -> str:
        """``items`` in order, each ``(expression, optional)``, ``separator`` between those present."""
        if not items:
            return '""'
        # rest[i]: items i.. after at least one was written; first[i]: items i.. when none was yet.
        rest, first = '""', '""'
        for expression, optional in reversed(items):
            with_sep = f"{self.lit(separator)} {expression} {rest}" if separator else f"{expression} {rest}"
            alone = f"{expression} {rest}"
            new_rest = self.rule(f"{with_sep} | {rest}" if optional else with_sep)
            new_first = self.rule(f"{alone} | {first}" if optional else alone)
            rest, first = new_rest, new_first
        return first

    def text(self) -> str:
        return "\n".join(["%llguidance {}", *self.lines]) + "\n"


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


def _regex(text: str) -> str:
    """``text`` as a Lark regular expression literal."""
    return "/" + text.replace("/", "\\/") + "/"


def _anywhere(text: str) -> str:
    """A regular expression of any text holding ``text``."""
    return _regex(f"(?s:.*){re.escape(text)}(?s:.*)")


def _pattern(pattern: str) -> str:
    """A JSON-schema ``pattern`` (found anywhere in the value, unless anchored) as a whole-value expression."""
    head = pattern[1:] if pattern.startswith("^") else "(?s:.*)" + pattern
    tail = head[:-1] if head.endswith("$") and not head.endswith("\\$") else head + "(?s:.*)"
    return _regex(f"(?:{tail})" if pattern.startswith("^") else tail)


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
    parts = [_regex(f"(?s:.{{{lo},{'' if hi is None else hi}}})")]
    if schema and isinstance(schema.get("pattern"), str):
        parts.append(_pattern(schema["pattern"]))
    parts += [f"~{_anywhere(f)}" for f in raw.forbid]
    if raw.strip:
        parts.append(_regex(r"(\S((?s:.*)\S)?)?"))
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


# --- the whole grammar --------------------------------------------------------------------


def grammar(calls: ToolCalls, markers: Markers, in_reasoning: bool = False) -> str:
    """The Lark grammar of a reply held to ``calls`` (``in_reasoning``: the prompt opened the model's reasoning).
    Raises ``Inexpressible`` for a tool whose schema the format cannot hold, ``ValueError`` for a format it
    cannot write."""
    fmt = resolve(calls.format, markers)
    if fmt is None or not markers.start:
        raise ValueError(f"no grammar writes the tool-call format {calls.format!r}")
    if not calls.tools:
        raise ValueError("a grammar of tool calls needs at least one tool")
    g = Lark(markers)
    after = g.rule(fmt.after_start(g, calls.tools, calls.parallel))
    section = g.rule(f"{g.lit(markers.start)} {after}")
    many = calls.parallel and fmt.sections
    if calls.required:
        calls_rule = f"{section} ({g.lit(fmt.between)} {section})*" if many else section
        g.lines.insert(0, f"start: {_reasoning(g, in_reasoning)} {calls_rule}")
        return g.text()
    g.lines.insert(0, _lazy_start(g, after, section, many, bool(fmt.sections and markers.end)))
    return g.text()


def _reasoning(g: Lark, in_reasoning: bool) -> str:
    """What may come before forced calls: the model's reasoning block (the rest of it, when the prompt opened
    it), then a little white space."""
    if g.markers.think is None:
        return ""
    opening, closing = g.markers.think
    text = g.terminal(_regex("(?s:.*)"))
    if closing in g.markers.specials:
        rest = g.rule(f"{text} {g.lit(closing)}")
    else:
        rest = g.rule(f"{text} {g.lit(closing)}", lazy=True)  # ends at the first closing marker
    gap = g.terminal(_GAP)
    if in_reasoning:
        return f"{rest} {gap}"
    return f"({g.lit(opening)} {rest} {gap})?"


def _lazy_start(g: Lark, after: str, section: str, many: bool, text_after: bool) -> str:
    """Free text, in which a call the model opens is completed (``many``: several sections, with text between;
    ``text_after``: the format leaves its calls' section, so text may follow; Mistral's never does)."""
    text = g.terminal(_regex("(?s:.*)"))
    # Wakes at the first opening marker: written as text (a lazy lexeme ends at its first match), or as its
    # special token, which is never part of the text before it.
    opened = g.rule(f"{text} {json.dumps(g.markers.start, ensure_ascii=False)}", lazy=True)
    if g.markers.start in g.markers.specials:
        opened = g.rule(f"{text} {g.lit(g.markers.start)} | {opened}")
    call = g.rule(f"{opened} {after}")
    specials = g.markers.free_specials()
    pieces = [call] if many and text_after else []
    if specials:
        pieces.append(f"{text} <[{_ranges(specials)}]>")
    free = g.rule(" | ".join(pieces)) + "*" if pieces else ""
    if many and text_after:
        return f"start: {free} {text}"
    last = call if text_after or not many else g.rule(f"{call} {section}*")  # Mistral's: calls to the end
    return f"start: {free} ({text} | {last})"


def _ranges(ids: list[int]) -> str:
    """Token ids as llguidance's ranges (``3-16,42``)."""
    out: list[str] = []
    first = last = ids[0]
    for i in ids[1:]:
        if i == last + 1:
            last = i
            continue
        out.append(f"{first}-{last}" if last > first else str(first))
        first = last = i
    out.append(f"{first}-{last}" if last > first else str(first))
    return ",".join(out)


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
