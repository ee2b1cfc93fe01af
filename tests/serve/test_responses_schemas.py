"""serve/responses_schemas.py: a Responses ``input`` as the chat template's messages, each error naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from mlxpipe.serve.door import ApiError
from mlxpipe.serve.responses_schemas import input_messages


def test_a_string_is_one_user_message() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_items_become_messages_and_consecutive_calls_one_assistant_turn() -> None:
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "summary": []},  # an earlier turn's reasoning: dropped
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
        {"type": "function_call_output", "call_id": "c9", "output": [{"type": "input_text", "text": "?"}]},
    ])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Paris and Rome?"
    calls = messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, {}]  # objects; empty: none
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "22 C", "name": "get_weather"}
    assert messages[4] == {"role": "tool", "tool_call_id": "c9", "content": "?"}  # no call of that id: no name


@pytest.mark.parametrize(("value", "param"), [
    ([], "input"),
    (3, "input"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"type": "function_call", "name": "f"}], "input[0]"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "telepathy_call"}], "input[0]"),
])
def test_each_bad_item_is_a_400_naming_it(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        input_messages(value)
    assert (info.value.status, info.value.param) == (400, param)
