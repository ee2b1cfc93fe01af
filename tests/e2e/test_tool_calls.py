"""Tool calls that always parse: ``tool_choice`` enforced by the grammar engine, on 2 ranks, through the SDKs.

A tiny random model whose chat template takes tools (``fixtures.tool_model``: Qwen2.5's hermes format, mlx-lm's
``json_tools`` parser) writes noise on its own, so only the grammar can make its replies tool calls. Every door that
has a ``tool_choice`` (OpenAI's chat completions, Anthropic's messages, OpenAI's responses) forces calls, required
and named, over many sampled replies, streamed and whole: each must come back as the door's own tool call, parsed,
its arguments valid against the tool's schema. A reply with the tool's result continues the conversation;
``parallel_tool_calls: false`` gives exactly one call; under ``auto`` a call the model starts is completed. One
server for the module. The grammar alone: ``tests/worker/generation/test_tool_grammar.py``; the bodies:
``tests/serve/test_tool_choice.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from fixtures.schemas import SCHEMAS
from fixtures.serve_process import ServeProcess, ready_server

MAX_TOKENS = 160  # one call is ~40-90 tokens of the byte tokenizer
PER_DOOR = 8  # sampled replies per door: streamed and whole, required and named (2 of each)
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tool_server(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ready_server(["--model", str(tool_model), "--hostfile", "hostfiles/local-2.json", "--max-concurrency", "4",
                       "--decode-batch", "2"], tmp_path_factory.mktemp("tools-home")) as proc:
        yield proc


def _valid(name: str, arguments: Any) -> dict[str, Any]:
    """A call's arguments (a JSON text or an object), checked against its tool's schema."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


# --- each door: a forced call, streamed or whole, as (tool name, arguments) pairs and the reason it ended -------


def _openai_call(client: openai.OpenAI, model: str, seed: int, stream: bool, choice: Any,
                 max_tokens: int = MAX_TOKENS, **extra: Any) -> tuple[list[Any], str]:
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    kwargs = dict(model=model, messages=[{"role": "user", "content": ASK}], tools=tools, tool_choice=choice,
                  max_tokens=max_tokens, temperature=1.0, seed=seed, **extra)
    if not stream:
        first = client.chat.completions.create(**kwargs).choices[0]
        return [(c.function.name, c.function.arguments) for c in first.message.tool_calls or []], first.finish_reason
    calls, finish = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            calls += [(c.function.name, c.function.arguments) for c in chunk.choices[0].delta.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
    return calls, finish


def _anthropic_call(client: anthropic.Anthropic, model: str, seed: int, stream: bool, choice: Any,
                    max_tokens: int = MAX_TOKENS, **extra: Any) -> tuple[list[Any], str]:
    tools = [{"name": n, "description": f"{n} of a place", "input_schema": s} for n, s in SCHEMAS.items()]
    kwargs = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": ASK}],
              "tools": tools, "tool_choice": choice, "extra_body": {"seed": seed, "temperature": 1.0}}
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"], str(message.stop_reason)


def _responses_call(client: openai.OpenAI, model: str, seed: int, stream: bool, choice: Any,
                    max_tokens: int = MAX_TOKENS, **extra: Any) -> tuple[list[Any], str]:
    tools = [{"type": "function", "name": n, "parameters": s, "strict": True} for n, s in SCHEMAS.items()]
    kwargs = dict(model=model, input=ASK, tools=tools, tool_choice=choice, max_output_tokens=max_tokens,
                  temperature=1.0, extra_body={"seed": seed}, **extra)
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"], str(response.status)


# door -> (its call, its required and named tool_choice, the reason a reply of calls ends with)
DOORS: dict[str, tuple[Callable[..., tuple[list[Any], str]], Any, Any, str]] = {
    "openai": (_openai_call, "required", {"type": "function", "function": {"name": "get_time"}}, "tool_calls"),
    "anthropic": (_anthropic_call, {"type": "any"}, {"type": "tool", "name": "get_time"}, "tool_use"),
    "responses": (_responses_call, "required", {"type": "function", "name": "get_time"}, "completed"),
}


def _one_call(door: str, choice: Any) -> tuple[Any, dict[str, Any]]:
    """``choice`` and the body's other fields for one call at most (Anthropic says it inside its tool_choice)."""
    if door == "anthropic":
        return {**choice, "disable_parallel_tool_use": True}, {}
    return choice, {"parallel_tool_calls": False}


@pytest.fixture(scope="module")
def clients(tool_server: ServeProcess, tool_model: Path) -> dict[str, Any]:
    """Each door's SDK client, and the model's name."""
    oai = openai.OpenAI(base_url=tool_server.url, api_key="none", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=tool_server.base, api_key="none", max_retries=0, timeout=300)
    return {"openai": oai, "responses": oai, "anthropic": claude, "model": str(tool_model)}


@pytest.mark.ranks
@pytest.mark.parametrize("door", DOORS)
def test_every_forced_call_parses_and_validates_in_every_door(door: str, clients: dict[str, Any]) -> None:
    call, required, named, ended = DOORS[door]
    # Seed i: streamed when odd, named when i % 4 >= 2; one call each (several: the next test).
    cases = [(seed, seed % 2 == 1, named if seed % 4 >= 2 else required) for seed in range(PER_DOOR)]

    def ask(case: tuple[int, bool, Any]) -> tuple[list[Any], str]:
        choice, extra = _one_call(door, case[2])
        return call(clients[door], clients["model"], case[0], case[1], choice, **extra)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, cases))
    seen = set()
    for (seed, _, choice), (calls, reason) in zip(cases, replies, strict=False):
        assert len(calls) == 1 and reason == ended, (seed, calls, reason)
        name, arguments = calls[0]
        seen.add(json.dumps(_valid(name, arguments), sort_keys=True))
        if choice is named:
            assert name == "get_time"
    assert len(seen) >= 4  # sampled: not one call over and over


@pytest.mark.ranks
@pytest.mark.parametrize("door", DOORS)
def test_several_calls_in_one_reply_each_parse_and_validate(door: str, clients: dict[str, Any]) -> None:
    call, required, _, _ = DOORS[door]
    counts = []
    for seed in range(4):
        # Room for several calls; one the limit cuts is left out of the reply, never returned broken.
        calls, _ = call(clients[door], clients["model"], seed, seed % 2 == 1, required, max_tokens=500)
        assert calls
        for name, arguments in calls:
            _valid(name, arguments)
        counts.append(len(calls))
    assert max(counts) > 1, counts


@pytest.mark.ranks
def test_a_reply_with_the_tools_result_continues_the_conversation(clients: dict[str, Any]) -> None:
    oai, claude, model = clients["openai"], clients["anthropic"], clients["model"]
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    first = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}], tools=tools,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    (call,) = first.choices[0].message.tool_calls
    history = [{"role": "user", "content": ASK}, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = oai.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=12, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len("18 C and sunny")  # the call and its result

    # Anthropic: the tool_use block back, and its tool_result.
    tools_a = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
    reply = claude.messages.create(model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ASK}],
                                   tools=tools_a, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"seed": 3, "temperature": 1.0})
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    history_a = [{"role": "user", "content": ASK},
                 {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    follow = claude.messages.create(model=model, max_tokens=12, tools=tools_a, messages=history_a,
                                    extra_body={"temperature": 0})
    assert follow.usage.input_tokens > reply.usage.input_tokens

    # Responses: the function_call_output after the stored response.
    tools_r = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    response = oai.responses.create(model=model, input=ASK, tools=tools_r, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, temperature=1.0,
                                    extra_body={"seed": 5})
    (fc,) = [o for o in response.output if o.type == "function_call"]
    after = oai.responses.create(model=model, previous_response_id=response.id, tools=tools_r,
                                 max_output_tokens=12, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "18 C"}])
    assert after.status in ("completed", "incomplete")
    assert after.usage.input_tokens > response.usage.input_tokens


@pytest.mark.ranks
@pytest.mark.parametrize("stream", [False, True])
def test_under_auto_a_call_the_model_starts_is_completed(clients: dict[str, Any], tool_model: Path,
                                                         stream: bool) -> None:
    from mlx_lm.tokenizer_utils import load

    opening = load(tool_model).encode("<tool_call>", add_special_tokens=False)
    assert len(opening) == 1
    # The bias makes the noise model open a call at once; only the grammar makes the rest well-formed.
    for seed in range(6):
        calls, finish = _openai_call(clients["openai"], clients["model"], seed, stream, "auto",
                                     parallel_tool_calls=False, logit_bias={str(opening[0]): 100})
        assert len(calls) == 1 and finish == "tool_calls", (calls, finish)
        _valid(*calls[0])
