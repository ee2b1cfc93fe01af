"""serve/tool_choice.py: what each door's tool_choice, parallel_tool_calls and strict tools ask of the grammar.

In-process, on the tiny tool tokenizer (``fixtures.tool_model``): each door's body becomes the ``ToolCalls`` rank 0
holds the reply to, or a 400 naming the field when it cannot be held. The replies themselves are checked on ranks
(``tests/e2e/test_tool_calls.py``) and the grammar alone in ``tests/worker/generation/test_tool_grammar.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fixtures.tool_model import write_tool_tokenizer
from mlxpipe.protocol.request import Request
from mlxpipe.protocol.tools import Tool, ToolCalls
from mlxpipe.serve import anthropic_schemas, ollama_schemas, openai_schemas, responses_schemas
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.responses_store import ResponseStore

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
# A schema llguidance cannot compile (a $ref to nowhere): held loosely unless the tool is strict.
BROKEN = {"type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}}
SETTINGS = ServerSettings(model_id="tiny", api_key=None, context=4096, vocab_size=320)
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_lm.tokenizer_utils import load

    dest = tmp_path_factory.mktemp("tool-tokenizer")
    write_tool_tokenizer(dest)
    return load(dest)


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"req-{next(counter)}"


# Each door: its body with tools (name -> schema; strict names), a tool_choice in its own spelling, the parse.
def openai(tools: dict[str, dict[str, Any]], choice: Any = None, strict: tuple[str, ...] = (), **extra: Any) -> Any:
    body = {"messages": [{"role": "user", "content": ASK}],
            "tools": [{"type": "function", "function": {"name": n, "parameters": s, **({"strict": True} if n in strict
                                                                                         else {})}}
                      for n, s in tools.items()], **extra}
    if choice is not None:
        body["tool_choice"] = choice
    return lambda tok: openai_schemas.parse(body, True, SETTINGS, tok, _ids()).request


def anthropic(tools: dict[str, dict[str, Any]], choice: Any = None, strict: tuple[str, ...] = (), **extra: Any) -> Any:
    body = {"max_tokens": 64, "messages": [{"role": "user", "content": ASK}],
            "tools": [{"name": n, "input_schema": s, **({"strict": True} if n in strict else {})}
                      for n, s in tools.items()], **extra}
    if choice is not None:
        body["tool_choice"] = choice
    return lambda tok: anthropic_schemas.parse(body, SETTINGS, tok, _ids()).request


def responses(tools: dict[str, dict[str, Any]], choice: Any = None, strict: tuple[str, ...] = (), **extra: Any) -> Any:
    body = {"input": ASK, "tools": [{"type": "function", "name": n, "parameters": s,
                                     **({"strict": True} if n in strict else {})} for n, s in tools.items()], **extra}
    if choice is not None:
        body["tool_choice"] = choice
    return lambda tok: responses_schemas.parse(body, SETTINGS, tok, _ids(), ResponseStore()).request


TOOLS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"openai": {"type": "function", "function": {"name": "get_time"}},
         "anthropic": {"type": "tool", "name": "get_time"},
         "responses": {"type": "function", "name": "get_time"}}
REQUIRED = {"openai": "required", "anthropic": {"type": "any"}, "responses": "required"}
DOORS = {"openai": openai, "anthropic": anthropic, "responses": responses}


@pytest.mark.parametrize("door", DOORS)
def test_required_holds_the_reply_to_calls_of_every_tool(tokenizer: Any, door: str) -> None:
    request = DOORS[door](TOOLS, REQUIRED[door])(tokenizer)
    assert request.tool_calls == ToolCalls("json_tools", (Tool("get_weather", WEATHER), Tool("get_time", TIME)),
                                           required=True, parallel=True)


@pytest.mark.parametrize("door", DOORS)
def test_a_named_tool_holds_the_reply_to_that_tool_alone(tokenizer: Any, door: str) -> None:
    request = DOORS[door](TOOLS, NAMED[door])(tokenizer)
    assert request.tool_calls == ToolCalls("json_tools", (Tool("get_time", TIME),), required=True)


@pytest.mark.parametrize("door", DOORS)
def test_auto_completes_a_call_the_model_starts(tokenizer: Any, door: str) -> None:
    request = DOORS[door](TOOLS)(tokenizer)
    assert request.tool_calls is not None and not request.tool_calls.required and request.tool_calls.parallel


@pytest.mark.parametrize(("door", "extra", "choice"), [
    ("openai", {"parallel_tool_calls": False}, "required"),
    ("responses", {"parallel_tool_calls": False}, "required"),
    ("anthropic", {}, {"type": "any", "disable_parallel_tool_use": True}),
])
def test_parallel_tool_calls_false_allows_one_call(tokenizer: Any, door: str, extra: dict[str, Any],
                                                   choice: Any) -> None:
    request = DOORS[door](TOOLS, choice, **extra)(tokenizer)
    assert request.tool_calls is not None and request.tool_calls.parallel is False


@pytest.mark.parametrize(("door", "choice"), [("openai", "none"), ("anthropic", {"type": "none"}),
                                              ("responses", "none")])
def test_none_withholds_the_tools_and_holds_nothing(tokenizer: Any, door: str, choice: Any) -> None:
    request = DOORS[door](TOOLS, choice)(tokenizer)
    assert request.tool_calls is None
    assert b"get_weather" not in tokenizer.decode(request.tokens).encode()


def test_openai_allowed_tools_narrow_the_tools_called(tokenizer: Any) -> None:
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    request = openai(TOOLS, choice)(tokenizer)
    assert request.tool_calls == ToolCalls("json_tools", (Tool("get_weather", WEATHER),), required=True)


def test_responses_allowed_tools_narrow_the_tools_called(tokenizer: Any) -> None:
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}
    request = responses(TOOLS, choice)(tokenizer)
    assert request.tool_calls == ToolCalls("json_tools", (Tool("get_time", TIME),))


@pytest.mark.parametrize("door", DOORS)
def test_a_tool_that_is_not_strict_and_cannot_be_held_is_loosened(tokenizer: Any, door: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    request = DOORS[door]({**TOOLS, "broken": BROKEN}, REQUIRED[door])(tokenizer)
    assert request.tool_calls is not None
    assert request.tool_calls.tools[-1] == Tool("broken", {"type": "object"})  # any arguments, still parsed
    assert request.tool_calls.tools[0] == Tool("get_weather", WEATHER)  # the others held to their schema
    # One line in the server's output names the tool held loosely.
    lines = [line for line in capsys.readouterr().err.splitlines() if "'broken'" in line]
    assert len(lines) == 1 and "held to parse, not to its schema" in lines[0], lines


@pytest.mark.parametrize("door", DOORS)
def test_a_strict_tool_that_cannot_be_held_is_a_400_naming_it(tokenizer: Any, door: str) -> None:
    with pytest.raises(ApiError) as info:
        DOORS[door]({**TOOLS, "broken": BROKEN}, strict=("broken",))(tokenizer)
    assert (info.value.status, info.value.param) == (400, "tools")
    assert "'broken' is strict" in info.value.message and "nowhere" in info.value.message


@pytest.mark.parametrize(("door", "choice", "param"), [
    ("openai", {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ("openai", "sometimes", "tool_choice"),
    ("anthropic", {"type": "tool", "name": "nope"}, "tool_choice.name"),
    ("anthropic", {"type": "any", "disable_parallel_tool_use": "yes"}, "tool_choice.disable_parallel_tool_use"),
    ("responses", {"type": "function", "name": "nope"}, "tool_choice.name"),
    ("responses", {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "nope"}]},
     "tool_choice.tools"),
])
def test_a_bad_tool_choice_is_a_400_naming_it(tokenizer: Any, door: str, choice: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        DOORS[door](TOOLS, choice)(tokenizer)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("door", DOORS)
def test_a_model_without_a_tool_call_format_refuses_to_force_one(tmp_path: Path, door: str) -> None:
    from mlx_lm.tokenizer_utils import load

    from fixtures.tiny_models import write_tokenizer

    write_tokenizer(tmp_path)  # the tiny tokenizer's plain template: no tools, no parser
    plain = load(tmp_path)
    with pytest.raises(ApiError) as info:
        DOORS[door](TOOLS, REQUIRED[door])(plain)
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    assert "no tool-call format" in info.value.message
    assert DOORS[door](TOOLS)(plain).tool_calls is None  # auto: the model's own calls, as before


def test_a_format_mlxpipe_cannot_write_refuses_to_force_one_and_says_which(tokenizer: Any) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from mlx_lm.tool_parsers import gemma4

    gemma = TokenizerWrapper(tokenizer._tokenizer, BPEStreamingDetokenizer, eos_token_ids=[258],
                             tool_parser=gemma4.parse_tool_call, tool_call_start=gemma4.tool_call_start,
                             tool_call_end=gemma4.tool_call_end)
    with pytest.raises(ApiError) as info:
        openai(TOOLS, "required")(gemma)
    assert info.value.param == "tool_choice"
    assert "'gemma4'" in info.value.message and "json_tools" in info.value.message


def test_a_draft_model_refuses_to_force_a_call_and_leaves_auto_alone(tokenizer: Any) -> None:
    from dataclasses import replace

    draft = replace(SETTINGS, draft_model=True)
    body = {"messages": [{"role": "user", "content": ASK}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]}
    with pytest.raises(ApiError) as info:
        openai_schemas.parse(body, True, draft, tokenizer, _ids())
    assert info.value.param == "tool_choice" and "--draft-model" in info.value.message
    assert openai_schemas.parse({**body, "tool_choice": "auto"}, True, draft, tokenizer, _ids()).request.tool_calls \
        is None


def test_a_forced_call_cannot_follow_a_prefilled_reply(tokenizer: Any) -> None:
    body = {"max_tokens": 64, "tool_choice": {"type": "any"}, "tools": [{"name": "get_time", "input_schema": TIME}],
            "messages": [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Sure"}]}
    with pytest.raises(ApiError) as info:
        anthropic_schemas.parse(body, SETTINGS, tokenizer, _ids())
    assert info.value.param == "tool_choice"


def test_a_forced_call_and_a_response_format_cannot_both_hold(tokenizer: Any) -> None:
    with pytest.raises(ApiError) as info:
        openai(TOOLS, "required", response_format={"type": "json_object"})(tokenizer)
    assert info.value.param == "tool_choice" and "response_format" in info.value.message


def test_ollama_completes_a_call_the_model_starts(tokenizer: Any) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": ASK}],
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]}
    request: Request = ollama_schemas.parse(body, True, SETTINGS, tokenizer, _ids()).request
    assert request.tool_calls == ToolCalls("json_tools", (Tool("get_time", TIME),))
