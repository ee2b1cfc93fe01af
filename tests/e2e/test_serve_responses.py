"""The OpenAI Responses door of ``mlxpipe serve``, with the official ``openai`` package's ``client.responses``.

Against the session's shared server (the chat model on 2 ranks, key ``KEY``): greedy replies must be mlx-lm's
alone on the same chat-template input. Its template (SmolLM2's) has no tool calls, so the function calls the
model writes are checked through the same door over a scripted queue (``fixtures.chat_reference``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fixtures.chat_reference import greedy, is_eos, prompt
from fixtures.schemas import RESPONSES_WEATHER_TOOL as WEATHER_TOOL
from fixtures.schemas import WEATHER_FUNCTION
from fixtures.schemas import user_turn as _user
from fixtures.serve_process import KEY, ServeProcess

MAX_TOKENS = 8
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.ranks
def test_a_response_is_token_identical_to_mlx_lm(client: openai.OpenAI, chat_model: Path) -> None:
    instructions = "You answer in one short sentence."
    messages = [{"role": "system", "content": instructions}, *_user(QUESTION)]
    text, tokens = greedy(chat_model, messages, MAX_TOKENS)
    reply = client.responses.create(model=str(chat_model), instructions=instructions, input=QUESTION,
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert reply.output_text == text and [i.type for i in reply.output] == ["message"]
    assert reply.status == ("completed" if is_eos(chat_model, tokens[-1]) else "incomplete")
    assert reply.usage.output_tokens == len(tokens)
    assert reply.usage.input_tokens == len(prompt(chat_model, messages))
    assert reply.object == "response" and reply.model == str(chat_model)


def _stream(client: openai.OpenAI, model: Path, max_tokens: int, **body: Any) -> tuple[list[Any], Any]:
    with client.responses.stream(model=str(model), input="Hi", max_output_tokens=max_tokens, **body) as stream:
        events = list(stream)
    return events, events[-1].response  # the last event's response (the SDK's final one only if completed)


def _check_events(events: list[Any], final: Any, ended: str) -> None:
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          ended]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.ranks
def test_a_streamed_response_has_the_responses_events(client: openai.OpenAI, chat_model: Path) -> None:
    """Greedy, as mlx-lm streams it (the chat model's random words run to ``max_output_tokens``: incomplete); then a
    reply that ends by itself (a grammar ends it: response.completed)."""
    text, tokens = greedy(chat_model, _user("Hi"), 12)
    events, final = _stream(client, chat_model, 12, temperature=0)
    _check_events(events, final, "response.completed" if is_eos(chat_model, tokens[-1]) else "response.incomplete")
    assert final.output_text == text and final.usage.output_tokens == len(tokens)
    word = {"type": "object", "properties": {"w": {"enum": ["yes", "no"]}}, "required": ["w"],
            "additionalProperties": False}
    events, final = _stream(client, chat_model, 40, temperature=0,
                            text={"format": {"type": "json_schema", "name": "w", "schema": word, "strict": True}})
    _check_events(events, final, "response.completed")
    assert json.loads(final.output_text)["w"] in ("yes", "no")


@pytest.mark.ranks
def test_a_function_call_round_trip_reaches_the_template(client: openai.OpenAI, chat_model: Path) -> None:
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
    text, _ = greedy(chat_model, template_messages, MAX_TOKENS, tools=[WEATHER_FUNCTION])
    reply = client.responses.create(model=str(chat_model), input=items, tools=[WEATHER_TOOL],
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    assert reply.output_text == text


@pytest.mark.ranks
def test_previous_response_id_continues_the_conversation_from_the_cache(client: openai.OpenAI, server: ServeProcess,
                                                                        chat_model: Path) -> None:
    first = client.responses.create(model=str(chat_model), input="Tell me about Paris.",
                                    max_output_tokens=MAX_TOKENS, temperature=0)
    second = client.responses.create(model=str(chat_model), input="And about Rome?", previous_response_id=first.id,
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    history = [*_user("Tell me about Paris."), {"role": "assistant", "content": first.output_text},
               *_user("And about Rome?")]
    assert second.output_text == greedy(chat_model, history, MAX_TOKENS)[0]
    assert second.usage.input_tokens == len(prompt(chat_model, history))
    # Everything up to the first reply is reused from the ranks' prompt cache; only the new turn is prefilled.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=str(chat_model), input="hi", previous_response_id="resp_unknown",
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
    ({**_OK, "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
    ({**_OK, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({**_OK, "temperature": "hot"}, 400, "temperature"),
    ({**_OK, "model": "gpt-other"}, 404, "model"),
]


# Bounded, so the grammar ends the reply within max_output_tokens whatever is drawn: at most
# '{"city": "' + 12 letters (no escapes) + '", "population": ' + 8 digits + '}' = 48 tokens of one
# character, and the end. Unbounded, some draws ran out of tokens inside the string (status incomplete).
CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z .-]{1,12}$", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}},
        "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.ranks
def test_text_format_json_schema_constrains_the_reply(client: openai.OpenAI, chat_model: Path) -> None:
    import jsonschema

    reply = client.responses.create(
        model=str(chat_model), input="Name a city and its population.", max_output_tokens=64, temperature=0.8,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        extra_body={"seed": 5},
    )
    assert reply.status == "completed", reply.output_text  # the grammar ends the reply, not max_output_tokens
    jsonschema.validate(json.loads(reply.output_text), CITY)


@pytest.mark.ranks
@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_is_a_4xx_naming_the_field(server: ServeProcess, body: dict[str, Any], status: int,
                                              param: str) -> None:
    since = len(server.err)
    response = httpx.post(f"{server.url}/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert server.said(f"refused POST /v1/responses (responses): {status} '{param}'", since)
