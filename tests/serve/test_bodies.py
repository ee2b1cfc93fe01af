"""serve/bodies.py: system turns wherever a conversation has them, the thinking switch, hosted tools, the context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from fixtures.tiny_models import CHAT_TEMPLATE, write_tokenizer
from mlxpipe.protocol.request import Request
from mlxpipe.serve import bodies
from mlxpipe.serve.door import ApiError, ContextTooLong, ServerSettings

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
