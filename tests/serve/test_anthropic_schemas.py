"""serve/anthropic_schemas.py: Messages bodies as the chat template's messages, each error naming its field."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from fixtures.tiny_models import write_tokenizer
from mlxpipe.serve.anthropic_schemas import Parsed, chat_messages, parse
from mlxpipe.serve.door import ApiError, ServerSettings

SETTINGS = ServerSettings(model_id="m", api_key=None, context=4096, any_model_name=True)


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
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
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


def test_a_system_message_among_the_messages_is_a_system_turn_where_it_stands() -> None:
    """Claude Code sends one after the first user message (its agents' list)."""
    messages, _ = chat_messages({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "Agents: Explore."},
        {"role": "developer", "content": [{"type": "text", "text": "No emoji."}]}, {"role": "user", "content": "Go"}]})
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "system", "content": "Agents: Explore."}, {"role": "system", "content": "No emoji."},
                        {"role": "user", "content": "Go"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return load_tokenizer(path)


def _parse(tokenizer: Any, **body: Any) -> Parsed:
    return parse({"max_tokens": 64000, "messages": [{"role": "user", "content": "Hi"}], **body}, SETTINGS, tokenizer,
                 lambda: "req-1")


def test_what_claude_code_sends_is_taken_and_what_cannot_be_honoured_said(tokenizer: Any) -> None:
    parsed = _parse(tokenizer, model="claude-opus-4-8", thinking={"type": "adaptive"}, metadata={"user_id": "u"},
                    context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    output_config={"effort": "high"}, stream=True,
                    system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
                    tools=[{"name": "Bash", "description": "Run.", "input_schema": {"type": "object"},
                            "cache_control": {"type": "ephemeral"}},
                           {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
                    mcp_servers=[{"type": "url", "url": "https://example.invalid/mcp", "name": "x"}])
    assert parsed.model == "claude-opus-4-8" and [t["function"]["name"] for t in parsed.tools or []] == ["Bash"]
    assert parsed.request.max_tokens == 4096 - len(parsed.request.tokens)  # clamped to what the context leaves
    assert parsed.notes == [
        "thinking adaptive -> the template's thinking switch on",
        "built-in tools left out (only function tools reach the model): web_search",
        "context_management not applied: this server edits no context",
        "mcp_servers left out: this server connects to none",
        "output_config.effort high not applied",
        f"max_tokens 64000 -> {parsed.request.max_tokens}: what the context (4096) leaves",
    ]


@pytest.mark.parametrize(("thinking", "switch"), [({"type": "enabled", "budget_tokens": 2048}, True),
                                                  ({"type": "adaptive"}, True), ({"type": "disabled"}, False)])
def test_thinking_is_the_templates_thinking_switch(tokenizer: Any, thinking: dict[str, Any], switch: bool) -> None:
    parsed = _parse(tokenizer, thinking=thinking)
    assert parsed.request.chat_template_config == {"enable_thinking": switch}


def test_output_config_format_is_a_structured_output(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    parsed = _parse(tokenizer, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert parsed.request.response_format == {"type": "json_schema",
                                              "json_schema": {"name": "output", "schema": schema, "strict": True}}
    with pytest.raises(ApiError) as info:
        _parse(tokenizer, output_config={"format": {"type": "yaml"}})
    assert info.value.param == "output_config.format"


def test_earlier_turns_of_hosted_tools_are_dropped_and_said() -> None:
    notes: list[str] = []
    messages, _ = chat_messages({"messages": [
        {"role": "user", "content": "Search."},
        {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
                                          {"type": "web_search_tool_result", "tool_use_id": "s", "content": []},
                                          {"type": "text", "text": "Found."}]},
        {"role": "user", "content": "Thanks."}]}, notes)
    assert messages[1] == {"role": "assistant", "content": "Found."}
    assert notes == ["earlier turns' hosted tool blocks dropped: server_tool_use, web_search_tool_result"]


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
