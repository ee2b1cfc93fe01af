"""The Anthropic Messages door of ``mlxpipe serve``, with the official ``anthropic`` package as client.

Against the session's shared server (the chat model on 2 ranks, key ``KEY``): greedy replies must be mlx-lm's
alone on the same chat-template input. Its template (SmolLM2's) has no tool calls, so the tool calls the
model writes are checked through the same door over a scripted queue (``fixtures.chat_reference``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from fixtures.chat_reference import greedy, is_eos, prompt, stop_in
from fixtures.schemas import ANTHROPIC_WEATHER_TOOL as WEATHER_TOOL
from fixtures.schemas import WEATHER_FUNCTION
from fixtures.schemas import user_turn as _user
from fixtures.serve_process import KEY, ServeProcess

MAX_TOKENS = 8
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # recent SDKs take no temperature argument: it goes through extra_body


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.ranks
def test_a_message_is_token_identical_to_mlx_lm(client: anthropic.Anthropic, chat_model: Path) -> None:
    system = "You answer in one short sentence."
    text, tokens = greedy(chat_model, [{"role": "system", "content": system}, *_user(QUESTION)], MAX_TOKENS)
    reply = client.messages.create(model=str(chat_model), max_tokens=MAX_TOKENS, system=[{"type": "text",
                                   "text": system}], messages=_user(QUESTION), extra_body=GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == text
    assert reply.stop_reason == ("end_turn" if is_eos(chat_model, tokens[-1]) else "max_tokens")
    assert reply.usage.output_tokens == len(tokens) and reply.stop_sequence is None
    prompt_tokens = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert prompt_tokens == len(prompt(chat_model, [{"role": "system", "content": system}, *_user(QUESTION)]))
    assert reply.role == "assistant" and reply.model == str(chat_model) and reply.id.startswith("msg_")


@pytest.mark.ranks
def test_a_streamed_message_has_anthropics_event_sequence(server: ServeProcess, chat_model: Path) -> None:
    text, tokens = greedy(chat_model, _user("Hi"), 12)
    body = {"model": str(chat_model), "max_tokens": 12, "messages": _user("Hi"), "stream": True,
            **GREEDY}
    # Raw events: the SDK's stream hides the pings.
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=120) as response:
        lines = list(response.iter_lines())
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    events = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    end = events[-2]
    assert end["usage"]["output_tokens"] == len(tokens)
    assert end["delta"]["stop_reason"] == ("end_turn" if is_eos(chat_model, tokens[-1]) else "max_tokens")


@pytest.mark.ranks
def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic, chat_model: Path) -> None:
    text, _ = greedy(chat_model, _user(QUESTION), 20)
    stop = stop_in(text)  # a word of mlx-lm's reply, midway
    with client.messages.stream(model=str(chat_model), max_tokens=20, messages=_user(QUESTION),
                                stop_sequences=[stop, "never said"], extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        reply = stream.get_final_message()
    assert streamed == reply.content[0].text == text[: text.index(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.ranks
def test_a_tool_turn_reaches_the_template_as_mlx_lm_gives_it(client: anthropic.Anthropic, chat_model: Path) -> None:
    """tool_use then tool_result: the template reads the assistant's tool call and a tool message, with the tools."""
    messages = [
        *_user("What is the weather in Paris?"),
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "22 C and sunny"}]}]},
    ]
    template_messages = [
        *_user("What is the weather in Paris?"),
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "22 C and sunny"},
    ]
    text, _ = greedy(chat_model, template_messages, MAX_TOKENS, tools=[WEATHER_FUNCTION])
    reply = client.messages.create(model=str(chat_model), max_tokens=MAX_TOKENS, messages=messages,
                                   tools=[WEATHER_TOOL], tool_choice={"type": "auto"}, extra_body=GREEDY)
    assert reply.content[0].text == text
    counted = client.messages.count_tokens(model=str(chat_model), messages=messages, tools=[WEATHER_TOOL])
    assert counted.input_tokens == len(prompt(chat_model, template_messages, [WEATHER_FUNCTION]))


@pytest.mark.ranks
def test_a_last_assistant_message_is_continued(client: anthropic.Anthropic, chat_model: Path) -> None:
    messages = [*_user(QUESTION), {"role": "assistant", "content": "The capital"}]
    text, _ = greedy(chat_model, messages, MAX_TOKENS, prefill=True)
    reply = client.messages.create(model=str(chat_model), max_tokens=MAX_TOKENS, messages=messages, extra_body=GREEDY)
    assert reply.content[0].text == text


_OK: dict[str, Any] = {"max_tokens": 5, "messages": _user("hi")}
BAD = [
    ({"messages": _user("hi")}, 400, "max_tokens"),
    ({**_OK, "messages": []}, 400, "messages"),
    ({**_OK, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ({**_OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x",
                                                                                    "media_type": "image/png"}}]}]},
     400, "messages[0].content[0]"),
    ({**_OK, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     400, "messages[0].content[0]"),
    ({**_OK, "system": 3}, 400, "system"),
    ({**_OK, "temperature": -1}, 400, "temperature"),
    ({**_OK, "top_k": "many"}, 400, "top_k"),
    ({**_OK, "stop_sequences": "x" * 2000}, 400, "stop_sequences"),
    ({**_OK, "tools": [{"name": "no_schema"}]}, 400, "tools[0]"),
    ({**_OK, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, 400, "tool_choice.name"),
    ({**_OK, "model": "claude-other"}, 404, "model"),
]


@pytest.mark.ranks
@pytest.mark.parametrize(("body", "status", "field"), BAD)
def test_bad_input_is_a_4xx_in_anthropics_shape_naming_the_field(server: ServeProcess, body: dict[str, Any],
                                                                  status: int, field: str) -> None:
    since = len(server.err)
    response = httpx.post(f"{server.base}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and field in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    # One line in the server's output says it: door, status, field, reason.
    assert server.said(f"refused POST /v1/messages (anthropic): {status} '{field}", since)


@pytest.mark.ranks
def test_a_wrong_key_is_anthropics_authentication_error(server: ServeProcess, chat_model: Path) -> None:
    wrong = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=str(chat_model), max_tokens=5, messages=_user("hi"))
    assert e.value.body["error"]["type"] == "authentication_error"
    # A bearer token is the same key.
    response = httpx.post(f"{server.base}/v1/messages/count_tokens", json={"messages": _user("hi")},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200 and response.json()["input_tokens"] > 0
