"""serve/bodies.py: system turns wherever a conversation has them, the thinking switch, hosted tools, the context;
images with tools, earlier calls and template variables in every door, as mlx-vlm's prompt."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from fixtures.tiny_models import CHAT_TEMPLATE, write_tokenizer
from fixtures.vision_models import VisionModels
from fixtures.vision_models import test_image as picture_bytes
from mlxpipe.protocol.request import Request
from mlxpipe.serve import bodies
from mlxpipe.serve.door import ApiError, ContextTooLong, ServerSettings
from mlxpipe.vision.images import check_image as image_of

# Templates as published do one of three things with a system turn after the first: show it where it is
# (ChatML's), refuse it (Mistral's and Qwen3's raise), or leave it out without a word.
_ONLY_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
               "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_DROPS_LATER = ("{% for m in messages %}{% if m['role'] != 'system' or loop.first %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Agents: Explore, Plan."}, {"role": "user", "content": "Go"}]


def _tokenizer(tmp_path: Path, template: str) -> Any:
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(tmp_path)


def _shown(tokenizer: Any, messages: list[dict[str, Any]], notes: bodies.Notes) -> str:
    return tokenizer.decode(bodies.tokens_for(tokenizer, Request(messages=messages), None, None, "messages", notes))


def test_a_system_turn_stays_where_it_is_when_the_template_shows_it(tmp_path: Path) -> None:
    notes: bodies.Notes = []
    shown = _shown(_tokenizer(tmp_path, CHAT_TEMPLATE), CONVERSATION, notes)
    assert shown.index("Hi") < shown.index("<|im_start|>system\nAgents: Explore, Plan.") < shown.index("Go")
    assert notes == []


@pytest.mark.parametrize("template", [_ONLY_FIRST, _DROPS_LATER], ids=["refuses", "drops"])
def test_system_turns_are_merged_into_the_first_where_the_template_takes_one(tmp_path: Path, template: str) -> None:
    notes: bodies.Notes = []
    shown = _shown(_tokenizer(tmp_path, template), CONVERSATION, notes)
    assert shown.startswith("<|im_start|>system\nYou are terse.\n\nAgents: Explore, Plan.<|im_end|>")
    assert shown.count("<|im_start|>system") == 1 and shown.index("Hi") < shown.index("Go")
    assert notes == ["2 system turns merged into the first: the chat template takes one"]


def test_one_system_turn_first_is_the_template_s_own_affair(tmp_path: Path) -> None:
    notes: bodies.Notes = []
    shown = _shown(_tokenizer(tmp_path, _ONLY_FIRST), CONVERSATION[:2], notes)
    assert shown.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and notes == []


@pytest.mark.parametrize(("given", "enabled", "expected"), [
    (None, None, None),  # the body says nothing: mlx-lm's default (on where the model has think tokens)
    (None, False, {"enable_thinking": False}),
    ({"top": 1}, True, {"top": 1, "enable_thinking": True}),
])
def test_the_thinking_switch_is_set_from_the_body(given: dict[str, Any] | None, enabled: bool | None,
                                                   expected: dict[str, Any] | None) -> None:
    request = bodies.thinking(Request(chat_template_config=given), {}, enabled)
    assert request.chat_template_config == (expected if expected is not None else given)


def test_chat_template_kwargs_that_set_thinking_win() -> None:
    body = {"chat_template_kwargs": {"enable_thinking": True}}
    request = bodies.thinking(Request(chat_template_config={"enable_thinking": True}), body, False)
    assert request.chat_template_config == {"enable_thinking": True}


@pytest.mark.parametrize(("kind", "is_built_in"), [
    ("web_search", True), ("web_search_20250305", True), ("web_search_preview", True), ("file_search", True),
    ("code_interpreter", True), ("code_execution_20250825", True), ("computer_use_preview", True), ("mcp", True),
    ("function", False), ("custom", False), ("namespace", False), (None, False), ("websearch", False),
])
def test_built_in_tools_are_known_by_type(kind: str | None, is_built_in: bool) -> None:
    assert bodies.built_in(kind) is is_built_in


def test_max_tokens_beyond_what_the_context_leaves_is_clamped_and_said() -> None:
    settings = ServerSettings(model_id="m", api_key=None, context=100)
    notes: bodies.Notes = []
    ranked = bodies.for_ranks(Request(max_tokens=64000), list(range(30)), settings, "messages", lambda: "req-1",
                              notes=notes)
    assert ranked.max_tokens == 70 and notes == ["max_tokens 64000 -> 70: what the context (100) leaves"]
    quiet: bodies.Notes = []
    assert bodies.for_ranks(Request(max_tokens=5), [1], settings, "messages", lambda: "r", notes=quiet).max_tokens == 5
    assert quiet == []


def test_a_prompt_the_context_cannot_hold_is_refused_with_both_counts() -> None:
    settings = ServerSettings(model_id="m", api_key=None, context=100)
    with pytest.raises(ContextTooLong) as info:
        bodies.for_ranks(Request(), list(range(100)), settings, "input", lambda: "r")
    assert (info.value.prompt_tokens, info.value.context, info.value.param) == (100, 100, "input")


def test_a_model_name_is_echoed_or_a_404() -> None:
    settings = ServerSettings(model_id="m", api_key=None, context=100, served_names=("alias",))
    assert bodies.check_model({}, settings) == "m"
    assert bodies.check_model({"model": "alias"}, settings) == "alias"
    with pytest.raises(ApiError) as info:
        bodies.check_model({"model": "gpt-other"}, settings)
    assert info.value.status == 404 and "--any-model-name" in info.value.message


# --- images with tools, earlier calls, their results and the thinking switch: every door, mlx-vlm's tokens ---------

_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_DATA_URI = "data:image/png;base64,"


def _picture(seed: int = 0) -> str:
    return base64.b64encode(picture_bytes(seed)).decode()


def _door_body(door: str) -> dict[str, Any]:
    """One conversation in ``door``'s own shape: a system turn, a picture and a question, the model's call of
    get_weather and its result; the tools, a forced call (where the door has tool_choice), thinking on."""
    data, ask, result = _picture(), "Where is this?", "sunny, 21 c"
    if door == "openai":
        return {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _DATA_URI + data}},
                                         {"type": "text", "text": ask}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}}],
            "tool_choice": "required", "parallel_tool_calls": False, "reasoning_effort": "high"}
    if door == "anthropic":
        source = {"type": "base64", "media_type": "image/png", "data": data}
        return {"max_tokens": 64, "system": "Be brief.", "messages": [
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": ask}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": result}]}],
            "tools": [{"name": "get_weather", "input_schema": _SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if door == "responses":
        return {"instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": _DATA_URI + data},
                                         {"type": "input_text", "text": ask}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": result}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": _SCHEMA}],
            "tool_choice": "required", "parallel_tool_calls": False, "reasoning": {"effort": "high"}}
    return {"messages": [  # Ollama: no tool_choice (a call the model starts is completed under the grammar)
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ask, "images": [data]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": result, "tool_name": "get_weather"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}}],
        "think": True}


@pytest.fixture(scope="module")
def vision_door(vision_models: VisionModels) -> tuple[ServerSettings, Any, Path]:
    """A vision-language model's server settings and the controller's tokenizer, as ``serve`` loads them."""
    from mlx_lm.utils import load_tokenizer as load_controller_tokenizer

    from mlxpipe.vision.prompt import VisionPrompt

    path = vision_models["qwen2_5_vl"]
    config = json.loads((path / "config.json").read_text())
    settings = ServerSettings(model_id="m", api_key=None, context=4096, vision=VisionPrompt(path, config))
    return settings, load_controller_tokenizer(path, eos_token_ids=config["eos_token_id"]), path


def _parse(door: str, body: dict[str, Any], settings: ServerSettings, tokenizer: Any) -> Any:
    from mlxpipe.serve import anthropic_schemas, ollama_schemas, openai_schemas, responses_schemas
    from mlxpipe.serve.responses_store import ResponseStore

    if door == "openai":
        return openai_schemas.parse(body, True, settings, tokenizer, lambda: "id")
    if door == "anthropic":
        return anthropic_schemas.parse(body, settings, tokenizer, lambda: "id")
    if door == "responses":
        return responses_schemas.parse(body, settings, tokenizer, lambda: "id", ResponseStore())
    return ollama_schemas.parse(body, True, settings, tokenizer, lambda: "id")


def _mlx_vlm_tokens(path: Path, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    pictures: tuple[int, ...] = (0,), **kwargs: Any) -> list[int]:
    """Single-process mlx-vlm's prompt tokens of ``messages`` and the test pictures of seeds ``pictures``."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import get_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens
    from PIL import Image as Pil

    model, processor = load(str(path))
    text = get_chat_template(processor, messages, add_generation_prompt, **kwargs)
    inputs = prepare_inputs(processor, images=[Pil.open(io.BytesIO(picture_bytes(s))) for s in pictures], prompts=text,
                            image_token_index=getattr(model.config, "image_token_index", None),
                            add_special_tokens=should_add_special_tokens(model.config.model_type, processor))
    return [int(t) for t in inputs["input_ids"].reshape(-1).tolist()]


_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is this?"}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 c"}]
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}}]


@pytest.mark.parametrize(("door", "param"), [("openai", "messages[1].content[0]"),
                                           ("anthropic", "messages[0].content[0]"),
                                           ("responses", "input[0].content[0]"), ("ollama", "messages[1].images")])
def test_an_image_to_a_vision_model_without_the_extra_names_the_extra(door: str, param: str) -> None:
    """A vision-language model served by an install without mlx-vlm runs as text: every door refuses its images
    with one line that says which extra to install, not that the model is text-only."""
    settings = ServerSettings(model_id="m", api_key=None, context=4096, vision_missing=True)
    with pytest.raises(ApiError) as info:
        _parse(door, _door_body(door), settings, None)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message == (f"'{param}' is an image: images need mlx-vlm, which this install lacks "
                                  "(on the server: pip install 'mlxpipe[vision]')")


@pytest.mark.parametrize("door", ["openai", "anthropic", "responses", "ollama"])
def test_images_with_tools_are_mlx_vlms_prompt(vision_door: tuple[ServerSettings, Any, Path], door: str) -> None:
    """A picture with tools, an earlier call and its result, and the door's thinking switch: the prompt is the
    tokens mlx-vlm makes of the same conversation and tools, and the reply is held to the tool-call grammar as a
    text model's is (forced where the door forces it, one call where parallel calls are off)."""
    settings, tokenizer, path = vision_door
    parsed = _parse(door, _door_body(door), settings, tokenizer)
    request = parsed.request
    assert request.tokens == _mlx_vlm_tokens(path, _CONVERSATION, tools=_TOOLS, enable_thinking=True)
    assert len(request.images) == 1 and "<tool_response>" in request.vision_prompt
    assert request.vision_prompt.endswith("<|im_start|>assistant\n<think>\n")  # the thinking switch, on
    calls = request.tool_calls
    assert calls is not None and calls.format == "json_tools" and [t.name for t in calls.tools] == ["get_weather"]
    assert (calls.required, calls.parallel) == ((False, True) if door == "ollama" else (True, False))


def test_anthropic_prefill_with_an_image_is_continued(vision_door: tuple[ServerSettings, Any, Path]) -> None:
    """A last assistant message with a picture before it: the prompt ends in the prefill, as mlx-vlm's template
    continues it (``continue_final_message``)."""
    from mlxpipe.serve import anthropic_schemas

    settings, tokenizer, path = vision_door
    source = {"type": "base64", "media_type": "image/png", "data": _picture()}
    body = {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "Where?"}]},
        {"role": "assistant", "content": "It is"}]}
    request = anthropic_schemas.parse(body, settings, tokenizer, lambda: "id").request
    asked = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]},
             {"role": "assistant", "content": "It is"}]
    assert request.tokens == _mlx_vlm_tokens(path, asked, False, continue_final_message=True)
    assert request.vision_prompt.endswith("<|im_start|>assistant\nIt is")


def _screenshot_body(door: str) -> dict[str, Any]:
    """A screenshot tool's call, its result holding a picture (seed 0), then the user's own picture (seed 1)."""
    if door == "responses":
        def uri(seed: int) -> str:
            return _DATA_URI + _picture(seed)

        return {"tools": [{"type": "function", "name": "screenshot", "parameters": {"type": "object"}}], "input": [
            {"role": "user", "content": "Take a screenshot."},
            {"type": "function_call", "call_id": "t1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "t1", "output": [
                {"type": "input_text", "text": "Screenshot:"}, {"type": "input_image", "image_url": uri(0)}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": uri(1)},
                                         {"type": "input_text", "text": "And mine?"}]}]}

    def image(seed: int) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _picture(seed)}}

    shot = [{"type": "text", "text": "Screenshot:"}, image(0)]
    return {"max_tokens": 8, "tools": [{"name": "screenshot", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [image(1), {"type": "tool_result", "tool_use_id": "t1", "content": shot},
                                     {"type": "text", "text": "And mine?"}]}]}


@pytest.mark.parametrize("door", ["anthropic", "responses"])
def test_a_screenshot_in_a_tool_result(vision_door: tuple[ServerSettings, Any, Path], door: str) -> None:
    """A tool's result with a picture in it (a coding agent's screenshot), beside the user's own picture: the tool
    message's text and image parts reach the template as mlx-vlm's server gives them, the pictures in the order
    the template shows them (the tool message first), and the tokens are mlx-vlm's."""
    settings, tokenizer, path = vision_door
    request = _parse(door, _screenshot_body(door), settings, tokenizer).request
    conversation = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1",
         "content": [{"type": "text", "text": "Screenshot:"}, {"type": "image"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And mine?"}]}]
    tools = [{"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}]
    assert request.tokens == _mlx_vlm_tokens(path, conversation, pictures=(0, 1), tools=tools)
    assert [image.sha256 for image in request.images] == [image_of(picture_bytes(s)).sha256 for s in (0, 1)]
    assert "<tool_response>\nScreenshot:<|vision_start|>" in request.vision_prompt
