"""A Lark grammar for llguidance, written in a model's own tokens: the tokenizer's markers and the rules of a grammar.

llguidance's syntax is Lark's, with ``%json`` for a JSON schema inline, ``<[id]>`` for a special token and
``[lazy]`` for a lexeme that ends at its first match. Every added token of the tokenizer is a special token to
llguidance, never text, so a grammar must name each by its id wherever its text appears (``Markers.lit``). The
tool-call grammar (``tool_grammar``, each format's calls in ``tool_formats``) is written with these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# JSON as chat templates write it (``tojson``: ", " and ": "), as structured output writes it too.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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


def regex(text: str) -> str:
    """``text`` as a Lark regular expression literal."""
    return "/" + text.replace("/", "\\/") + "/"
