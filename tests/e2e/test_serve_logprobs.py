"""``logprobs`` / ``top_logprobs`` through the ``openai`` package, against the session's running server.

Rank 0 computes them from the very log-probabilities its sampler draws from, so the greedy token is the top of
its own list; the values must equal mlx-lm's own log-softmax for the same prompt (single-process
``stream_generate``, whose responses carry it), streamed or not, chat or legacy completions.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fixtures.option_reference import _reference_model
from fixtures.serve_process import KEY, ServeProcess

pytestmark = pytest.mark.ranks

MAX_TOKENS = 8
TOP = 5
# A question whose greedy reply's first token has no leading space (the chat model's: 'indexes'), which the
# detokenizer would trim from the reply's text: the tokens then join to the text exactly.
QUESTION = [{"role": "user", "content": "What day comes after Monday?"}]
TOLERANCE = 2e-3  # float32 on two ranks, batched decode, against one process


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@cache
def _reference(model_dir: str, prompt: str | None = None) -> tuple[list[int], list[list[float]], Any]:
    """Single-process mlx-lm, greedy: the tokens and each step's full log-softmax (as ``stream_generate`` gives it)."""
    from mlx_lm import stream_generate

    model, tokenizer = _reference_model(model_dir, None)  # loaded once for every test file that compares
    if prompt is None:
        text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    responses = list(stream_generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS))
    shown = [r for r in responses if r.token not in tokenizer.eos_token_ids]
    return [r.token for r in shown], [r.logprobs.tolist() for r in shown], tokenizer


def _check_against_mlx_lm(entries: list[Any], chat_model: Path, prompt: str | None = None) -> None:
    tokens, logprobs, tokenizer = _reference(str(chat_model), prompt)
    assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in tokens]
    for entry, token, row in zip(entries, tokens, logprobs, strict=True):
        assert entry["logprob"] == pytest.approx(row[token], abs=TOLERANCE)
        top = entry["top_logprobs"]
        assert len(top) == TOP
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]  # greedy = the maximum
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(sorted(row, reverse=True)[:TOP], abs=TOLERANCE)
        assert all(t["bytes"] == list(t["token"].encode()) for t in [entry, *top])


def test_chat_logprobs_are_mlx_lms_and_greedy_is_the_top(client: openai.OpenAI, chat_model: Path) -> None:
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                           max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP)
    choice = reply.choices[0]
    entries = [e.model_dump() for e in choice.logprobs.content]
    assert len(entries) == reply.usage.completion_tokens - (choice.finish_reason == "stop")  # one per shown token
    assert "".join(e["token"] for e in entries) == choice.message.content
    _check_against_mlx_lm(entries, chat_model)


def test_streamed_chat_logprobs_equal_the_whole_ones(client: openai.OpenAI, chat_model: Path) -> None:
    entries: list[dict[str, Any]] = []
    text = ""
    for chunk in client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION,
                                                max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                top_logprobs=TOP, stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            entries.extend(e.model_dump() for e in choice.logprobs.content)
    assert "".join(e["token"] for e in entries) == text
    _check_against_mlx_lm(entries, chat_model)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_carry_the_legacy_logprobs(client: openai.OpenAI, chat_model: Path, stream: bool) -> None:
    prompt = "The capital of France is"
    tokens, logprobs, tokenizer = _reference(str(chat_model), prompt)
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=3, stream=stream)
    parts = list(reply) if stream else [reply]
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        if part.choices and part.choices[0].logprobs is not None:
            for key in got:
                got[key].extend(getattr(part.choices[0].logprobs, key) or [])
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert got["tokens"] == [tokenizer.decode([t]) for t in tokens]
    # mlx-lm's streaming detokenizer drops the space a reply's first token starts with; the token keeps it.
    assert "".join(got["tokens"]).lstrip() == text.lstrip()
    assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(tokens))]
    for value, top, token, row in zip(got["token_logprobs"], got["top_logprobs"], tokens, logprobs, strict=True):
        assert value == pytest.approx(row[token], abs=TOLERANCE)
        assert len(top) == 3 and max(top.values()) == value


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
])
def test_bad_logprobs_fields_are_a_400_naming_them(server: ServeProcess, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": QUESTION, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
