"""From the tokens a request generates to what its client sees: text, stop strings, tool calls.

The ranks stream token ids; the controller turns them into text with the
model's own streaming detokenizer, and splits that text with mlx-lm's
``TextStateMachine`` (``make_text_state_machine``: reasoning and tool-call
markers, as ``mlx_lm.server`` does) and parses tool calls with the
tokenizer's own ``tool_parser`` through ``mlx_lm.server.ToolCallFormatter``.
Stop strings are matched on the text, so a stop string is found however the
model happened to tokenize it, and never streamed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class Delta:
    """What one step adds to a reply."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[str] = field(default_factory=list)  # raw tool-call texts, parsed by ``tool_calls``
    stopped: bool = False  # a stop string was reached: nothing more is shown

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls)


class StopFilter:
    """Passes text on until the first stop string; holds back what may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's ``stop_sequence``)

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self._held += text
        found = [(i, s) for s in self.stops if (i := self._held.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            out, self._held, self.stopped = self._held[:cut], "", True
            return out
        safe = max(0, len(self._held) - (max(len(s) for s in self.stops) - 1))
        out, self._held = self._held[:safe], self._held[safe:]
        return out

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class Reply:
    """One request's reply, token by token."""

    def __init__(self, tokenizer: TokenizerWrapper, stops: list[str], initial_state: str = "normal") -> None:
        self.tokenizer = tokenizer
        self._detokenizer = tokenizer.detokenizer
        self._machine = make_text_state_machine(tokenizer)
        self._state = self._machine.make_state(initial_state)
        self._previous = initial_state
        self._tool_text = ""
        self._stops = StopFilter(stops)
        self.tokens: list[int] = []
        self.made_tool_call = False

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self._stops.matched

    def add(self, token: int) -> Delta:
        """The reply's next token; the end-of-sequence token is not shown."""
        self.tokens.append(token)
        if token in self.tokenizer.eos_token_ids:
            return Delta()
        self._detokenizer.add_token(token)
        return self._split(self._detokenizer.last_segment)

    def finish(self, finish_reason: str | None) -> Delta:
        """What is still held back once the reply has ended."""
        self._detokenizer.finalize()
        delta = self._split(self._detokenizer.last_segment)
        if finish_reason == "length":
            self._state, rest, _ = TextStateMachine.flush(self._state)
            delta = _merge(delta, self._segments([(self._state[0], rest)]))
        if self._previous == "tool" and self._tool_text:
            delta.tool_calls.append(self._tool_text)
            self._tool_text, self.made_tool_call = "", True
        delta.text += self._stops.flush()
        return delta

    def _split(self, text: str) -> Delta:
        if not text:
            return Delta(stopped=self.stopped)
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._segments(segments)

    def _segments(self, segments: list[tuple[str | None, str]]) -> Delta:
        delta = Delta()
        for state, text in segments:
            if state == "reasoning":
                delta.reasoning += text
            elif state == "tool":
                self._tool_text += text
            else:
                if self._previous == "tool" and self._tool_text:
                    delta.tool_calls.append(self._tool_text)
                    self._tool_text, self.made_tool_call = "", True
                delta.text += self._stops.feed(text)
            self._previous = state or self._previous
        delta.stopped = self.stopped
        return delta


def _merge(a: Delta, b: Delta) -> Delta:
    return Delta(a.text + b.text, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls, a.stopped or b.stopped)


def tool_calls(
    tokenizer: TokenizerWrapper, texts: list[str], tools: list[Any] | None, streaming: bool
) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from raw tool-call texts, parsed as ``mlx_lm.server`` parses them."""
    if not texts or not getattr(tokenizer, "has_tool_calling", False):
        return []
    from mlx_lm.server import ToolCallFormatter

    calls: list[dict[str, Any]] = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)(texts)
    return calls
