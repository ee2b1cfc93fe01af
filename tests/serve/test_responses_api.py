"""serve/responses_api.py in-process: the real app and doors over a scripted queue.

Function calls the model writes, and malformed bodies through the Responses and Anthropic doors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue, prompt
from fixtures.schemas import RESPONSES_WEATHER_TOOL, WEATHER_FUNCTION, user_turn
from fixtures.serve_process import KEY
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog

TOOL_REPLY = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(demo_model: Path) -> Iterator[tuple[openai.OpenAI, ScriptedQueue]]:
    """The real app and door over a scripted queue, its tokenizer given mlx-lm's JSON tool parser."""
    tokenizer = load_tokenizer(demo_model, tokenizer_config_extra={"tool_parser_type": "json_tools"})
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096)
    queue = ScriptedQueue(tokenizer, TOOL_REPLY)
    with TestClient(build_app(queue, tokenizer, settings, RequestLog())) as http:  # type: ignore[arg-type]
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0), queue


@pytest.mark.parametrize("stream", [False, True], ids=["one-body", "streaming"])
def test_a_function_call_comes_back_as_an_item_and_goes_round(scripted: tuple[openai.OpenAI, ScriptedQueue],
                                                              demo_model: Path, stream: bool) -> None:
    client, queue = scripted
    if stream:
        with client.responses.stream(model="scripted", input="Weather in Paris?", tools=[RESPONSES_WEATHER_TOOL]) as s:
            kinds = [e.type for e in s]
            reply = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        reply = client.responses.create(model="scripted", input="Weather in Paris?", tools=[RESPONSES_WEATHER_TOOL])
    assert [i.type for i in reply.output] == ["message", "function_call"] and reply.output_text == "Checking."
    call = reply.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # The round trip: its output, after previous_response_id, reaches the template after the call.
    client.responses.create(model="scripted", previous_response_id=reply.id, tools=[RESPONSES_WEATHER_TOOL],
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}])
    expected = prompt(demo_model, [
        *user_turn("Weather in Paris?"),
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "22 C"}],
        [WEATHER_FUNCTION])
    assert queue.requests[-1].tokens == expected


NAMESPACED = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
              "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one.",
                         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Patch files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


@pytest.fixture
def replying(scripted: tuple[openai.OpenAI, ScriptedQueue]) -> Iterator[Callable[[str], openai.OpenAI]]:
    """The scripted client, its queue set to reply a given text for one test."""
    client, queue = scripted

    def reply(text: str) -> openai.OpenAI:
        queue.text = text
        return client

    yield reply
    queue.text = TOOL_REPLY


@pytest.mark.parametrize("stream", [False, True], ids=["one-body", "streaming"])
def test_a_namespaced_function_call_comes_back_under_its_own_name_and_namespace(
        replying: Callable[[str], openai.OpenAI], stream: bool) -> None:
    client = replying('<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"task": "x"}}\n</tool_call>')
    http: TestClient = client._client
    body = {"model": "scripted", "input": "Spawn.", "tools": [NAMESPACED, {"type": "web_search"}], "stream": stream}
    response = http.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        output = events[-1]["response"]["output"]
        assert "response.function_call_arguments.done" in [e["type"] for e in events]
    else:
        output = response.json()["output"]
    [call] = [i for i in output if i["type"] == "function_call"]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("spawn_agent", "multi_agent_v1",
                                                                                {"task": "x"})


@pytest.mark.parametrize("stream", [False, True], ids=["one-body", "streaming"])
def test_a_custom_tool_call_comes_back_as_a_custom_tool_call(replying: Callable[[str], openai.OpenAI],
                                                             stream: bool) -> None:
    client = replying('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}\n</tool_call>')
    http: TestClient = client._client
    body = {"model": "scripted", "input": "Patch.", "tools": [PATCH_TOOL], "stream": stream}
    response = http.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
        output = events[-1]["response"]["output"]
    else:
        output = response.json()["output"]
    [call] = [i for i in output if i["type"] == "custom_tool_call"]
    assert (call["name"], call["input"]) == ("apply_patch", "*** Begin Patch") and "namespace" not in call


# --- no body can break either door ---------------------------------------------------------------------------------

_JUNK: list[Any] = [None, True, 0, -1, 2**70, 1e308, "", "x" * 300, [], [1], {}, {"a": 1}, [[]], {"type": []},
                    [{"type": ["text"]}], [{"type": "text", "text": 3}], [{"role": ["user"], "content": "hi"}],
                    [{"type": "function_call"}], [{"type": "tool_result", "content": [{"type": {}}]}],
                    {"type": "tool", "name": ["x"]}, [{"type": "tool_use", "input": []}]]
_MESSAGES_FIELDS = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "tools", "tool_choice", "stream", "seed", "chat_template_kwargs", "thinking", "output_config",
                    "output_format", "context_management", "mcp_servers", "metadata"]
_RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                     "tool_choice", "stream", "store", "previous_response_id", "text", "top_logprobs", "metadata",
                     "reasoning", "include", "prompt_cache_key", "client_metadata", "parallel_tool_calls"]


def _fuzz(count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    import random

    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        if i % 2:
            body: dict[str, Any] = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            fields, path = _MESSAGES_FIELDS, "/v1/messages"
        else:
            body, fields, path = {"input": "hi", "max_output_tokens": 5}, _RESPONSES_FIELDS, "/v1/responses"
        for name in rng.sample(fields, rng.randint(1, 3)):
            body[name] = rng.choice(_JUNK)
        bodies.append((path, body))
    return bodies


def test_no_body_breaks_either_door(scripted: tuple[openai.OpenAI, ScriptedQueue]) -> None:
    """Hundreds of malformed bodies through the real doors: each a 4xx in its API's shape or a 200, never a 5xx."""
    http: TestClient = scripted[0]._client  # the TestClient the SDK was given
    statuses = []
    for path, body in _fuzz(400, seed=23):
        response = http.post(path, json=body, headers={"x-api-key": KEY})
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{path} {json.dumps(body)[:300]} -> {response.text[:300]}"
        if response.status_code >= 400:
            error = response.json()
            message = error["error"]["message"]
            assert message and (error.get("type") == "error") == (path == "/v1/messages"), error
    assert statuses.count(200) > 5 and statuses.count(400) > 200  # the legal ones ran too
