"""The grammar of a reply's tool calls, in the model's own tool-call format, for llguidance (``constraints``).

Two shapes of reply: ``required`` is calls from the first token (after the model's reasoning, if it thinks), one
or, with ``parallel``, more; otherwise free text in which the grammar wakes at the call's opening marker
(a lazy lexeme, or the marker's special token) and completes that call, and every special token but the end of
sequence stays allowed, so only a call the model starts is held. How each format writes a call is
``tool_formats``'s; the grammar is written with the tokenizer's markers (``lark_writer``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from mlxpipe.protocol.tools import ToolCalls
from mlxpipe.worker.generation.lark_writer import Lark, Markers, regex
from mlxpipe.worker.generation.tool_formats import resolve

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Between the end of the model's reasoning and its first call; bounded, so a small model cannot wander there.
_GAP = r"/[ \t\r\n]{0,4}/"


def starts_in_reasoning(tokenizer: TokenizerWrapper, tokens: list[int]) -> bool:
    """Whether the reply starts inside the model's reasoning (the prompt opened a think block), as mlx-lm's server
    decides it."""
    if not getattr(tokenizer, "has_thinking", False) or not tokens:
        return False
    return bool(tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens))


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
    text = g.terminal(regex("(?s:.*)"))
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
    text = g.terminal(regex("(?s:.*)"))
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
