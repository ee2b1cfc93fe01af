"""The Ollama door of ``mlxpipe serve``, with the official ``ollama`` package as client.

Against the session's shared server (the chat model on 2 ranks, key ``KEY``): greedy replies must be mlx-lm's
alone on the same input. Tool calls the model writes are checked over a scripted queue, as for the other doors.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest

from fixtures.chat_reference import greedy, is_eos, plain, prompt
from fixtures.serve_process import KEY, ServeProcess

MAX_TOKENS = 8
GREEDY = {"temperature": 0, "num_predict": MAX_TOKENS}


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> ollama.Client:
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.mark.ranks
def test_a_streamed_chat_is_token_identical_to_mlx_lm(client: ollama.Client, chat_model: Path) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text, tokens = greedy(chat_model, messages, MAX_TOKENS)
    pieces = list(client.chat(model=str(chat_model), messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == text
    last = pieces[-1]
    assert last.done and not any(p.done for p in pieces[:-1])
    assert last.done_reason == ("stop" if is_eos(chat_model, tokens[-1]) else "length")
    assert (last.eval_count, last.prompt_eval_count) == (len(tokens), len(prompt(chat_model, messages)))


@pytest.mark.ranks
def test_generate_applies_the_template_unless_raw(client: ollama.Client, chat_model: Path) -> None:
    question = "What is the capital of France?"
    templated = client.generate(model=str(chat_model), prompt=question, options=GREEDY)
    assert templated.response == greedy(chat_model, [{"role": "user", "content": question}], MAX_TOKENS)[0]
    raw = client.generate(model=f"{chat_model}:latest", prompt="The three primary colors are", raw=True,
                          options={**GREEDY, "stop": ["blue"]})
    expected = plain(chat_model, "The three primary colors are", MAX_TOKENS)
    assert raw.response == expected.split("blue")[0] and raw.done


@pytest.mark.ranks
def test_tags_and_show_name_the_served_model(client: ollama.Client, chat_model: Path) -> None:
    assert [m.model for m in client.list().models] == [str(chat_model)]
    assert "im_start" in client.show(str(chat_model)).template


@pytest.mark.ranks
@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"messages": [{"role": "user", "content": "hi"}], "format": "json"}, 400, "'format'"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "'messages[0].images'"),
    ({"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": -1}}, 400, "'options.temperature'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "'messages[0]'"),
    ({"model": "llama3:latest", "messages": [{"role": "user", "content": "hi"}]}, 404, "llama3"),
])
def test_bad_input_is_ollamas_error_naming_the_field(server: ServeProcess, body: dict, status: int,
                                                     fragment: str) -> None:
    since = len(server.err)
    response = httpx.post(f"{server.base}/api/chat", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30)
    assert response.status_code == status and fragment in response.json()["error"], response.text
    assert fragment in server.said(f"refused POST /api/chat (ollama): {status}", since)


@pytest.mark.ranks
def test_every_door_at_once_gives_mlx_lms_tokens(server: ServeProcess, client: ollama.Client,
                                                 chat_model: Path) -> None:
    """The same question through the Anthropic, Responses and Ollama doors at once (batched on the ranks)."""
    import anthropic
    import openai

    question = "Name a fruit."
    text, _ = greedy(chat_model, [{"role": "user", "content": question}], MAX_TOKENS)
    claude = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)
    gpt = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    asks = [
        lambda: claude.messages.create(model=str(chat_model), max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": question}]).content[0].text,
        lambda: gpt.responses.create(model=str(chat_model), input=question, max_output_tokens=MAX_TOKENS,
                                     temperature=0).output_text,
        lambda: client.chat(model=str(chat_model), messages=[{"role": "user", "content": question}],
                            options=GREEDY).message.content,
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        assert list(pool.map(lambda ask: ask(), asks)) == [text] * len(asks)
