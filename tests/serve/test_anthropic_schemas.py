"""serve/anthropic_schemas.py: Messages bodies as the chat template's messages, each error naming its field."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from mlxpipe.serve.anthropic_schemas import chat_messages
from mlxpipe.serve.door import ApiError


def test_blocks_become_the_messages_mlx_lm_server_gives_a_template() -> None:
    body = {"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "they want the weather"},  # an earlier turn's reasoning: dropped
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]}
    messages, prefill = chat_messages(body)
    assert prefill is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "Weather in Paris?"
    assert messages[2]["content"] == "Checking."
    (call,) = messages[2]["tool_calls"]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris"}  # an object, as templates read it
    # The tool result comes before the user's own text, and names the tool it answers.
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "22 C", "name": "get_weather"}
    assert messages[4] == {"role": "user", "content": "And tomorrow?"}


def test_a_last_assistant_message_is_the_prefill_the_reply_continues() -> None:
    messages, prefill = chat_messages({"messages": [{"role": "user", "content": "Count to 3."},
                                                    {"role": "assistant", "content": "1, 2,"}]})
    assert (messages, prefill) == ([{"role": "user", "content": "Count to 3."}], "1, 2,")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]},
     "messages[0].content[0]"),  # only an assistant calls tools
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": ""}]}]},
     "messages[0].content[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]}, "system[0]"),
])
def test_each_bad_part_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_messages(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert f"'{param}'" in info.value.message


def test_an_image_to_a_text_only_model_is_a_400_naming_the_block() -> None:
    from fixtures.vision_models import test_image as picture_bytes
    from mlxpipe.serve.anthropic_schemas import parse
    from mlxpipe.serve.door import ServerSettings

    data = base64.b64encode(picture_bytes(0)).decode()
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}
    with pytest.raises(ApiError) as info:
        parse(body, ServerSettings(model_id="m", api_key=None, context=4096), None, lambda: "x")  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, "messages[0].content[1]")
    assert "this server takes text only" in info.value.message
