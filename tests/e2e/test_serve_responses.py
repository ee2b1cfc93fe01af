"""The OpenAI Responses door of ``mlxpipe serve``, with the official ``openai`` package's ``client.responses``.

Against the session's shared server (the demo model on 2 ranks, key ``KEY``): greedy replies must be mlx-lm's
alone on the same chat-template input. The demo model's template has no tool calls, so the function calls the
model writes are checked through the same door over a scripted queue (``fixtures.chat_reference``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue, greedy, is_eos, prompt
from fixtures.serve_process import KEY, ServeProcess
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog
from mlxpipe.serve.responses_store import ResponseStore

MAX_TOKENS = 8
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_FUNCTION = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                     "parameters": WEATHER_TOOL["parameters"]}}


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.mark.ranks
def test_a_response_is_token_identical_to_mlx_lm(client: openai.OpenAI, demo_model: Path) -> None:
    instructions = "You answer in one short sentence."
    messages = [{"role": "system", "content": instructions}, *_user(QUESTION)]
    text, tokens = greedy(demo_model, messages, MAX_TOKENS)
    reply = client.responses.create(model=str(demo_model), instructions=instructions, input=QUESTION,
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert reply.output_text == text and [i.type for i in reply.output] == ["message"]
    assert reply.status == ("completed" if is_eos(demo_model, tokens[-1]) else "incomplete")
    assert reply.usage.output_tokens == len(tokens)
    assert reply.usage.input_tokens == len(prompt(demo_model, messages))
    assert reply.object == "response" and reply.model == str(demo_model)


@pytest.mark.ranks
def test_a_streamed_response_has_the_responses_events(client: openai.OpenAI, demo_model: Path) -> None:
    text, tokens = greedy(demo_model, _user("Hi"), 12)
    assert is_eos(demo_model, tokens[-1])  # a reply that ends by itself: response.completed
    with client.responses.stream(model=str(demo_model), input="Hi", max_output_tokens=12,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == text and final.usage.output_tokens == len(tokens)


@pytest.mark.ranks
def test_a_function_call_round_trip_reaches_the_template(client: openai.OpenAI, demo_model: Path) -> None:
    """A function_call item and its function_call_output: the template reads the call and a tool message."""
    items = [*_user("What is the weather in Paris?"),
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "22 C and sunny"}]
    template_messages = [
        *_user("What is the weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C and sunny"},
    ]
    text, _ = greedy(demo_model, template_messages, MAX_TOKENS, tools=[WEATHER_FUNCTION])
    reply = client.responses.create(model=str(demo_model), input=items, tools=[WEATHER_TOOL],
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert reply.output_text == text


@pytest.mark.ranks
def test_previous_response_id_continues_the_conversation_from_the_cache(client: openai.OpenAI, server: ServeProcess,
                                                                        demo_model: Path) -> None:
    first = client.responses.create(model=str(demo_model), input="Tell me about Paris.",
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    second = client.responses.create(model=str(demo_model), input="And about Rome?", previous_response_id=first.id,
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    history = [*_user("Tell me about Paris."), {"role": "assistant", "content": first.output_text},
               *_user("And about Rome?")]
    assert second.output_text == greedy(demo_model, history, MAX_TOKENS)[0]
    assert second.usage.input_tokens == len(prompt(demo_model, history))
    # Everything up to the first reply is reused from the ranks' prompt cache; only the new turn is prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=str(demo_model), input="hi", previous_response_id="resp_unknown",
                                max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "keeps the last 256" in e.value.body["message"]


_OK: dict[str, Any] = {"input": "hi", "max_output_tokens": 2}
BAD = [
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({**_OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strang"}}}}, 400,
     "text.format"),
    ({**_OK, "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({**_OK, "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({**_OK, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({**_OK, "temperature": "hot"}, 400, "temperature"),
    ({**_OK, "model": "gpt-other"}, 404, "model"),
]


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.ranks
def test_text_format_json_schema_constrains_the_reply(client: openai.OpenAI, demo_model: Path) -> None:
    import jsonschema

    reply = client.responses.create(
        model=str(demo_model), input="Name a city and its population.", max_output_tokens=40, temperature=0.8,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )
    assert reply.status == "completed", reply.output_text  # the grammar ends the reply, not max_output_tokens
    jsonschema.validate(json.loads(reply.output_text), CITY)


@pytest.mark.ranks
@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_is_a_4xx_naming_the_field(server: ServeProcess, body: dict[str, Any], status: int,
                                              param: str) -> None:
    response = httpx.post(f"{server.url}/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


# --- function calls the model writes (a scripted queue: the demo model's template has none) ---------------------


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
        with client.responses.stream(model="scripted", input="Weather in Paris?", tools=[WEATHER_TOOL]) as s:
            kinds = [e.type for e in s]
            reply = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        reply = client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER_TOOL])
    assert [i.type for i in reply.output] == ["message", "function_call"] and reply.output_text == "Checking."
    call = reply.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # The round trip: its output, after previous_response_id, reaches the template after the call.
    client.responses.create(model="scripted", previous_response_id=reply.id, tools=[WEATHER_TOOL],
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}])
    expected = prompt(demo_model, [
        *_user("Weather in Paris?"),
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "22 C"}],
        [WEATHER_FUNCTION])
    assert queue.requests[-1].tokens == expected


def test_the_store_is_bounded_in_number_bytes_and_time() -> None:
    now = [0.0]
    store = ResponseStore(capacity=2, ttl=10, max_bytes=1000, clock=lambda: now[0])
    for name in "abc":
        store.put(name, [], {})
    assert (store.get("a"), len(store)) == (None, 2)  # the oldest went
    now[0] = 11
    assert store.get("b") is None and store.get("c") is None  # expired
    by_size = ResponseStore(capacity=10, max_bytes=1000)
    for name in "bc":
        by_size.put(name, [], {})
    by_size.put("big", [{"content": "x" * 990}], {})
    assert (by_size.get("b"), by_size.get("c"), len(by_size)) == (None, None, 1)  # over 1000 bytes: the others went


# --- no body can break either door ---------------------------------------------------------------------------------

_JUNK: list[Any] = [None, True, 0, -1, 2**70, 1e308, "", "x" * 300, [], [1], {}, {"a": 1}, [[]], {"type": []},
                    [{"type": ["text"]}], [{"type": "text", "text": 3}], [{"role": ["user"], "content": "hi"}],
                    [{"type": "function_call"}], [{"type": "tool_result", "content": [{"type": {}}]}],
                    {"type": "tool", "name": ["x"]}, [{"type": "tool_use", "input": []}]]
_MESSAGES_FIELDS = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "tools", "tool_choice", "stream", "seed", "chat_template_kwargs"]
_RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                     "tool_choice", "stream", "store", "previous_response_id", "text", "top_logprobs", "metadata"]


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
