"""serve/responses_schemas.py: a Responses ``input`` as the chat template's messages, each error naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from fixtures.tiny_models import write_tokenizer
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.responses_schemas import Origin, Toolbox, input_messages, parse
from mlxpipe.serve.responses_store import ResponseStore

SETTINGS = ServerSettings(model_id="m", api_key=None, context=4096, served_names=("local-model",))


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


def _function(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": f"{name}.", "strict": False,
            "parameters": {"type": "object", "properties": {}}}


def test_a_namespace_is_flattened_and_each_name_maps_back() -> None:
    toolbox = Toolbox()
    made = toolbox.add({"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                        "tools": [_function("spawn_agent"), _function("wait_agent")]}, "tools[4]")
    assert [t["function"]["name"] for t in made] == ["multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"]
    assert toolbox.origin("multi_agent_v1__wait_agent") == Origin("wait_agent", "multi_agent_v1")
    assert toolbox.origin("exec_command") == Origin("exec_command")  # a name no namespace made: itself
    # OpenAI's own default namespace adds nothing to a name.
    toolbox.add({"type": "namespace", "name": "functions", "tools": [_function("wait")]}, "tools[5]")
    assert toolbox.tools[-1]["function"]["name"] == "wait" and toolbox.origin("wait").namespace == "functions"


def test_a_custom_tool_is_a_function_of_one_string() -> None:
    toolbox = Toolbox()
    [made] = toolbox.add({"type": "custom", "name": "apply_patch", "description": "Patch files.",
                          "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}, "tools[0]")
    assert made["function"]["parameters"]["properties"] == {"input": {"type": "string",
                                                                      "description": "The tool's input."}}
    assert "lark grammar: start: /.+/" in made["function"]["description"]
    assert toolbox.origin("apply_patch") == Origin("apply_patch", None, custom=True)


def test_earlier_calls_of_namespaced_and_custom_tools_reach_the_template_by_the_names_it_saw() -> None:
    dropped: list[str] = []
    messages = input_messages([
        {"type": "message", "role": "user", "content": "Go."},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
    ], Toolbox(), dropped)
    calls = messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["multi_agent_v1__spawn_agent", "apply_patch"]
    assert calls[1]["function"]["arguments"] == {"input": "*** Begin Patch"}
    assert [m.get("name") for m in messages[2:]] == ["multi_agent_v1__spawn_agent", "apply_patch"]
    assert dropped == ["web_search_call"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return load_tokenizer(path)


def test_what_codex_sends_is_taken_and_what_cannot_be_honoured_said(tokenizer: Any) -> None:
    body = {"model": "local-model", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"effort": "low", "summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "thread-1", "client_metadata": {"thread_id": "t"}, "text": {"verbosity": "low"},
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be safe."}]},
                      {"type": "additional_tools", "role": "developer",
                       "tools": [{"type": "namespace", "name": "clock", "tools": [_function("sleep")]}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "tools": [_function("exec_command"), {"type": "web_search", "external_web_access": False},
                      {"type": "namespace", "name": "multi_agent_v1", "tools": [_function("spawn_agent")]},
                      {"type": "image_generation"}, {"type": "telepathy"}]}
    parsed = parse(body, SETTINGS, tokenizer, lambda: "req-1", ResponseStore())
    assert parsed.model == "local-model" and not parsed.store
    assert [t["function"]["name"] for t in parsed.tools or []] == ["exec_command", "multi_agent_v1__spawn_agent",
                                                                  "clock__sleep"]
    assert parsed.request.chat_template_config == {"enable_thinking": True}
    assert parsed.conversation[0] == {"role": "system", "content": "Be safe."}
    assert parsed.notes == [
        "reasoning.effort low -> the template's thinking switch on",
        "built-in tools left out (only function tools reach the model): image_generation, web_search",
        "tools of unknown types left out: telepathy",
        "namespaces flattened to namespace__name: clock, multi_agent_v1",
    ]


@pytest.mark.parametrize(("effort", "switch"), [("none", False), ("minimal", True), ("xhigh", True)])
def test_reasoning_effort_is_the_templates_thinking_switch(tokenizer: Any, effort: str, switch: bool) -> None:
    parsed = parse({"input": "Hi", "reasoning": {"effort": effort}}, SETTINGS, tokenizer, lambda: "r", ResponseStore())
    assert parsed.request.chat_template_config == {"enable_thinking": switch}

