"""serve/generation.py: where a reply's text starts, and the model's reasoning in each door's own shape.

A template that opens the reply's think block (``THINKING_TEMPLATE``, as Qwen3's and DeepSeek-R1's do) makes the
reply start in the model's reasoning, as ``mlx_lm.server`` decides it; each door then gives it back its own way:
Anthropic's ``thinking`` blocks, a Responses ``reasoning`` item, chat's ``reasoning_content``, Ollama's
``thinking``. The body's own thinking switch (Anthropic's ``thinking``, ``reasoning.effort``, ``reasoning_effort``,
Ollama's ``think``) reaches the template.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue, thinking_tokenizer
from fixtures.serve_process import KEY
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.generation import initial_state
from mlxpipe.serve.queue import RequestLog

REPLY = "The user greets me.</think>Hello!"
_AUTH = {"Authorization": f"Bearer {KEY}"}
_HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, ScriptedQueue]]:
    tokenizer = thinking_tokenizer(tmp_path_factory.mktemp("thinking-tokenizer"))
    queue = ScriptedQueue(tokenizer, REPLY)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096)
    with TestClient(build_app(queue, tokenizer, settings, RequestLog())) as client:  # type: ignore[arg-type]
        yield client, queue


def test_a_reply_starts_in_reasoning_when_the_prompt_opens_a_think_block(tmp_path: Path) -> None:
    tokenizer = thinking_tokenizer(tmp_path)
    opened = tokenizer.apply_chat_template(_HI, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(_HI, add_generation_prompt=True, enable_thinking=False)
    assert initial_state(tokenizer, opened) == "reasoning" and initial_state(tokenizer, closed) == "normal"
    assert initial_state(tokenizer, []) == "normal"


def test_anthropic_thinking_comes_back_as_a_thinking_block(thinking: tuple[TestClient, ScriptedQueue]) -> None:
    client, _ = thinking
    body = {"max_tokens": 50, "messages": _HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = client.post("/v1/messages", json=body, headers=_AUTH).json()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in reply["content"]] == [
        ("thinking", "The user greets me."), ("text", "Hello!")]


def test_responses_reasoning_comes_back_as_a_reasoning_item(thinking: tuple[TestClient, ScriptedQueue]) -> None:
    client, _ = thinking
    reply = client.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "high"}}, headers=_AUTH).json()
    reasoning, message = reply["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "The user greets me."
    assert message["content"][0]["text"] == "Hello!"


def test_chat_reasoning_comes_back_as_reasoning_content(thinking: tuple[TestClient, ScriptedQueue]) -> None:
    client, _ = thinking
    reply = client.post("/v1/chat/completions", json={"messages": _HI, "reasoning_effort": "low"}, headers=_AUTH)
    message = reply.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets me.", "Hello!")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"max_tokens": 50, "messages": _HI, "thinking": {"type": "disabled"}}),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "none"}}),
    ("/v1/chat/completions", {"messages": _HI, "reasoning_effort": "none"}),
])
def test_thinking_turned_off_by_the_body_reaches_the_template(thinking: tuple[TestClient, ScriptedQueue], path: str,
                                                              body: dict[str, Any]) -> None:
    client, queue = thinking
    assert client.post(path, json=body, headers=_AUTH).status_code == 200
    tokenizer = queue.tokenizer
    assert tokenizer.decode(queue.requests[-1].tokens).endswith("<|im_start|>assistant\n")  # no think block opened


@pytest.mark.parametrize(("think", "opened"), [(True, True), ("high", True), (False, False)])
def test_ollamas_think_is_the_templates_thinking_switch(thinking: tuple[TestClient, ScriptedQueue], think: Any,
                                                        opened: bool) -> None:
    client, queue = thinking
    reply = client.post("/api/chat", json={"messages": _HI, "think": think, "stream": False}, headers=_AUTH).json()
    assert queue.tokenizer.decode(queue.requests[-1].tokens).endswith("<think>\n") is opened
    if opened:
        assert (reply["message"]["thinking"], reply["message"]["content"]) == ("The user greets me.", "Hello!")
