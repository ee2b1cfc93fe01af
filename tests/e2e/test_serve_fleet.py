"""``mlxpipe serve --fleet`` end to end: two tiny models behind one endpoint, on local ranks, through the real SDKs.

One server for the whole module: the chat model (the demo's tokenizer and template on tiny weights) on 2 ranks,
answering to ``big``, and a tiny qwen2 (byte tokenizer) in 2 replicas of one rank each, answering to ``small``.
Each name reaches its model, greedy output equal to that model alone in single-process mlx-lm, through OpenAI's,
Anthropic's and Ollama's clients; an unknown name is each door's 404 listing the names; the lists name both; each
request's line names the pipeline that served it. Two conversations spread over the replicas, and each returns to
the replica that holds its prefix. Last, SIGTERM drains the fleet: a stream in flight on one entry ends whole while
a new request to either entry gets a 503, then the server exits 143 with every rank gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from fixtures.chat_reference import greedy
from fixtures.processes import local_rank_processes
from fixtures.serve_process import KEY, ServeProcess, assert_drained_and_gone, ready_server, stream_through_sigterm
from fixtures.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.ranks

MAX_TOKENS = 8
CONTEXT = 2048
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NAMES = ["big", "small"]
DRAINED = 200  # a reply still running when SIGTERM comes (~4 s: the chat model decodes ~50 tok/s on 2 ranks)


@pytest.fixture(scope="module")
def models(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"big": chat_model, "small": make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("fleet") / "small")}


@pytest.fixture(scope="module")
def fleet(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("fleet-file")
    path, hostfile = folder / "fleet.yaml", folder / "local-4.json"
    path.write_text(f"models:\n  - model: {models['big']}\n    hosts: [0, 1]\n    names: [big]\n"
                    f"  - model: {models['small']}\n    hosts: [2, 3]\n    replicas: 2\n    names: [small]\n")
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 4))
    # --drain-seconds: far longer than the drained reply takes on a loaded machine (the last test).
    with ready_server(["--fleet", str(path), "--hostfile", str(hostfile), "--context", str(CONTEXT),
                       "--drain-seconds", "120"],
                      tmp_path_factory.mktemp("fleet-home"), env={"MLXPIPE_API_KEY": KEY}) as proc:
        yield proc


@pytest.mark.parametrize("name", NAMES)
def test_each_name_reaches_its_model_through_openai(fleet: ServeProcess, models: dict[str, Path], name: str) -> None:
    client = openai.OpenAI(base_url=fleet.url, api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                           temperature=0.0)
    assert reply.choices[0].message.content == greedy(models[name], MESSAGES, MAX_TOKENS)[0]
    assert reply.model == name
    label = name if name == "big" else "small#"  # either replica of small
    assert fleet.said(f"(openai, {label}")  # type: ignore[union-attr]


@pytest.mark.parametrize("name", NAMES)
def test_each_name_reaches_its_model_through_anthropic(fleet: ServeProcess, models: dict[str, Path],
                                                       name: str) -> None:
    client = anthropic.Anthropic(base_url=fleet.base, api_key=KEY, max_retries=0, timeout=120)
    # Recent SDKs take no temperature argument: it goes through extra_body.
    reply = client.messages.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                   extra_body={"temperature": 0})
    assert reply.content[0].text == greedy(models[name], MESSAGES, MAX_TOKENS)[0]  # type: ignore[union-attr]


@pytest.mark.parametrize("name", NAMES)
def test_each_name_reaches_its_model_through_ollama(fleet: ServeProcess, models: dict[str, Path], name: str) -> None:
    client = ollama.Client(host=fleet.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    reply = client.chat(model=f"{name}:latest", messages=MESSAGES, options={"num_predict": MAX_TOKENS,
                                                                            "temperature": 0.0})
    assert reply.message.content == greedy(models[name], MESSAGES, MAX_TOKENS)[0]


def test_an_unknown_name_is_each_doors_404_listing_the_names(fleet: ServeProcess, models: dict[str, Path]) -> None:
    listed = f"this server serves '{models['big']}', 'big', '{models['small']}', 'small'"
    with pytest.raises(openai.NotFoundError) as oa:
        openai.OpenAI(base_url=fleet.url, api_key=KEY, max_retries=0).chat.completions.create(
            model="gpt-4", messages=MESSAGES, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert listed in oa.value.message and oa.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as an:
        anthropic.Anthropic(base_url=fleet.base, api_key=KEY, max_retries=0).messages.create(
            model="claude-opus-4", messages=MESSAGES, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert listed in an.value.message
    with pytest.raises(ollama.ResponseError) as ol:
        ollama.Client(host=fleet.base, headers={"Authorization": f"Bearer {KEY}"}).chat(model="llama3",
                                                                                         messages=MESSAGES)
    assert ol.value.status_code == 404 and listed in ol.value.error


def test_the_lists_name_every_model(fleet: ServeProcess, models: dict[str, Path]) -> None:
    names = [str(models["big"]), "big", str(models["small"]), "small"]
    client = openai.OpenAI(base_url=fleet.url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == names
    headers = {"Authorization": f"Bearer {KEY}"}
    assert [m["name"] for m in httpx.get(f"{fleet.base}/api/tags", headers=headers).json()["models"]] == names
    assert [m.model for m in ollama.Client(host=fleet.base, headers=headers).ps().models] == names
    health = fleet.health()
    assert health["status"] == "ready"
    assert [(p["name"], len(p["ranks"])) for p in health["pipelines"]] == [("big", 2), ("small#0", 1), ("small#1", 1)]


def test_conversations_spread_over_the_replicas_and_each_returns_to_the_one_that_holds_its_prefix(
        fleet: ServeProcess, models: dict[str, Path]) -> None:
    """Two conversations to ``small`` (2 replicas): their first turns go to one replica each; their second turns,
    the second conversation's first, each to the replica that served its first (where load alone would send the
    second conversation's to the first replica), and each reuses its first turn's KV cache there."""
    client = openai.OpenAI(base_url=fleet.url, api_key=KEY, max_retries=0, timeout=120)
    system = {"role": "system", "content": "Be terse."}
    questions = {"a": "Name a city on a river, and the river.", "b": "Name a river that crosses three countries."}
    turns = {k: [system, {"role": "user", "content": q}] for k, q in questions.items()}

    def ask(key: str) -> tuple[str, Any]:
        since = len(fleet.err)
        reply = client.chat.completions.create(model="small", messages=turns[key], max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                               temperature=0.0)
        assert reply.choices[0].message.content == greedy(models["small"], turns[key], MAX_TOKENS)[0]
        line = fleet.said("(openai, small#", since)
        return line.split("(openai, ", 1)[1].split(")", 1)[0], reply

    first = {k: ask(k)[0] for k in ("a", "b")}
    assert sorted(first.values()) == ["small#0", "small#1"]
    for key in ("b", "a"):
        turns[key] += [{"role": "assistant", "content": greedy(models["small"], turns[key], MAX_TOKENS)[0]},
                       {"role": "user", "content": "And another?"}]
    for key in ("b", "a"):
        where, reply = ask(key)
        assert where == first[key]
        assert reply.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_sigterm_drains_every_pipeline_then_stops_every_rank_and_exits_143(fleet: ServeProcess,
                                                                           models: dict[str, Path]) -> None:
    """Last on ``fleet``: SIGTERM with a stream in flight on ``big``. A new request to either entry gets a 503 with
    Retry-After while the stream runs to its end, mlx-lm's reply whole; then the server stops, every pipeline's
    ranks with it."""
    pids = set(local_rank_processes(fleet.proc.pid))
    assert pids
    headers = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Write a long story."}]
    body = {"model": "big", "messages": messages, "max_tokens": DRAINED, "stream": True}

    def refuse() -> list[httpx.Response]:  # a new request to either entry
        return [httpx.post(f"{fleet.url}/chat/completions", headers=headers, timeout=30,
                           json={"model": name, "messages": MESSAGES, "max_tokens": MAX_TOKENS}) for name in NAMES]

    chunks = stream_through_sigterm(fleet, body, headers, refuse)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == greedy(models["big"], messages, DRAINED)[0]
    assert_drained_and_gone(fleet, pids)
