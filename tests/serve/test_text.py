"""serve/text.py: from generated tokens to what a client sees (stop strings, tool calls), on the demo tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxpipe.serve.text import Delta, Reply, StopFilter, tool_calls

TOOL_REPLY = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": CITY}}


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    """The demo model's tokenizer, given mlx-lm's JSON tool parser (its own template has none)."""
    return load_tokenizer(demo_model, tokenizer_config_extra={"tool_parser_type": "json_tools"})


def feed(reply: Reply, text: str, tokenizer: Any, finish: str | None = "stop") -> Delta:
    """Every token of ``text`` through ``reply``, then its end; all that was shown, as one delta."""
    shown = Delta()
    for token in tokenizer.encode(text, add_special_tokens=False):
        d = reply.add(token)
        shown = Delta(shown.text + d.text, shown.reasoning + d.reasoning, shown.tool_calls + d.tool_calls, d.stopped)
    end = reply.finish(finish)
    return Delta(shown.text + end.text, shown.reasoning + end.reasoning, shown.tool_calls + end.tool_calls,
                 shown.stopped or end.stopped)


@pytest.mark.parametrize("pieces", [["The capital is Par", "is."], ["The capital is P", "a", "r", "is."],
                                    ["The capital is Paris."]])
def test_a_stop_string_ends_the_text_however_it_was_cut(pieces: list[str]) -> None:
    stops = StopFilter(["Paris", "London"])
    shown = "".join(stops.feed(p) for p in pieces) + stops.flush()
    assert shown == "The capital is "
    assert (stops.stopped, stops.matched) == (True, "Paris")
    assert stops.feed("more") == ""


def test_text_that_may_begin_a_stop_string_is_held_back_and_none_is_lost() -> None:
    stops = StopFilter(["</end>"])
    first = stops.feed("one </e")  # the last 5 characters may begin '</end>': held back
    assert first == "on"
    second = stops.feed("lse>")
    assert first + second + stops.flush() == "one </else>" and not stops.stopped
    assert StopFilter([]).feed("anything") == "anything"
    assert StopFilter([""]).stops == []


def test_a_reply_stops_at_its_stop_string_and_hides_it(tokenizer: Any) -> None:
    reply = Reply(tokenizer, ["Paris"])
    shown = feed(reply, "The capital of France is Paris. It is large.", tokenizer)
    assert (shown.text, shown.stopped, reply.stop_string) == ("The capital of France is ", True, "Paris")


def test_the_end_of_sequence_token_is_not_shown(tokenizer: Any) -> None:
    reply = Reply(tokenizer, [])
    for token in tokenizer.encode("Hi", add_special_tokens=False):
        reply.add(token)
    eos = next(iter(tokenizer.eos_token_ids))
    assert not reply.add(eos)
    assert reply.tokens[-1] == eos


def test_a_tool_call_is_taken_out_of_the_text_and_parsed_as_mlx_lm_server_parses_it(tokenizer: Any) -> None:
    reply = Reply(tokenizer, [])
    shown = feed(reply, TOOL_REPLY, tokenizer)
    assert shown.text == "Checking." and reply.made_tool_call
    (call,) = tool_calls(tokenizer, shown.tool_calls, [WEATHER], streaming=False)
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "Paris"}'


def test_no_tool_call_texts_or_no_tool_parser_give_no_calls(tokenizer: Any, demo_model: Path) -> None:
    assert tool_calls(tokenizer, [], [WEATHER], streaming=False) == []
    plain = load_tokenizer(demo_model)
    assert tool_calls(plain, ['{"name": "x"}'], [WEATHER], streaming=False) == []
