"""serve/anthropic_api.py in-process: the real app and door over a scripted queue (tool calls the model writes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.schemas import ANTHROPIC_WEATHER_TOOL, user_turn
from fixtures.serve_process import KEY
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog

TOOL_REPLY = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(demo_model: Path) -> Iterator[anthropic.Anthropic]:
    """The real app and door over a scripted queue, its tokenizer given mlx-lm's JSON tool parser."""
    tokenizer = load_tokenizer(demo_model, tokenizer_config_extra={"tool_parser_type": "json_tools"})
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096)
    app = build_app(ScriptedQueue(tokenizer, TOOL_REPLY), tokenizer, settings, RequestLog())  # type: ignore[arg-type]
    with TestClient(app) as http:
        yield anthropic.Anthropic(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0)


def test_a_tool_call_comes_back_as_a_tool_use_block(scripted: anthropic.Anthropic) -> None:
    reply = scripted.messages.create(model="scripted", max_tokens=50, messages=user_turn("Weather in Paris?"),
                                     tools=[ANTHROPIC_WEATHER_TOOL])
    assert [b.type for b in reply.content] == ["text", "tool_use"]
    assert reply.content[0].text == "Checking."
    call = reply.content[1]
    assert (call.name, call.input, reply.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    assert call.id.startswith("toolu_")


def test_a_streamed_tool_call_is_an_input_json_delta(scripted: anthropic.Anthropic) -> None:
    with scripted.messages.stream(model="scripted", max_tokens=50, messages=user_turn("Weather in Paris?"),
                                  tools=[ANTHROPIC_WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "text_delta" in deltas and "input_json_delta" in deltas
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_a_prompt_over_the_context_is_anthropics_prompt_is_too_long(scripted: anthropic.Anthropic) -> None:
    """Anthropic's own words, with both counts: what Claude Code acts on (it compacts the conversation)."""
    with pytest.raises(anthropic.BadRequestError) as info:
        scripted.messages.create(model="scripted", max_tokens=50, messages=user_turn("word " * 5000))
    message = info.value.body["error"]["message"]
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 4096 maximum")
    assert int(message.split()[4]) > 4096
