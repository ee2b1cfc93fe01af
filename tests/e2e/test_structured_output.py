"""``response_format`` (``json_object``, ``json_schema``): constrained decoding, through the ``openai`` package.

A tiny random model's free text is noise, so only the grammar mask can make its replies JSON: sampled replies
must all parse and validate against their schema and end (``stop``) when the JSON does. One server on 2 ranks
for the module; constrained and free requests in flight together must each equal their solo (greedy) output,
since each request keeps its own grammar state. The fields and the grammar itself are checked without
ranks in ``tests/protocol/test_request.py`` and ``tests/worker/generation/test_constraints.py``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from fixtures.schemas import PERSON
from fixtures.schemas import schema_format as _schema_format
from fixtures.serve_process import ServeProcess, ready_server
from fixtures.tiny_models import TinyModels

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "tag": {"enum": ["a", "b"]}},
         "required": ["x", "tag"], "additionalProperties": False}
MAX_TOKENS = 120


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- a server on 2 ranks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ready_server(["--model", str(tiny_models["llama"]), "--hostfile", "hostfiles/local-2.json",
                       "--max-concurrency", "4", "--decode-batch", "2"],
                      tmp_path_factory.mktemp("grammar-home")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(tiny_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url, api_key="none", max_retries=0, timeout=120)


def _reply(client: openai.OpenAI, text: str, response_format: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    extra = {"response_format": response_format} if response_format is not None else {}
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=_ask(text),
                                          max_tokens=MAX_TOKENS, **extra, **kwargs)


@pytest.mark.ranks
def test_sampled_json_schema_replies_all_parse_and_validate(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda seed: _reply(client, f"Person {seed}?", _schema_format(PERSON),
                                                    temperature=1.0, seed=seed), range(4)))
    contents = [r.choices[0].message.content for r in replies]
    assert len(set(contents)) > 1, contents  # sampled, not one fixed string
    for reply, content in zip(replies, contents, strict=True):
        jsonschema.validate(json.loads(content), PERSON)
        assert reply.choices[0].finish_reason == "stop"  # it ended with the JSON


@pytest.mark.ranks
def test_json_object_replies_are_objects(client: openai.OpenAI) -> None:
    # A noise model's keys and values would run on: the bias on '}' (byte 125) lets the objects close early.
    reply = _reply(client, "Any object.", {"type": "json_object"}, temperature=1.0, seed=3,
                   logit_bias={"125": 6})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.ranks
def test_constrained_and_free_requests_together_each_equal_their_solo_output(client: openai.OpenAI) -> None:
    asks = [("Who?", _schema_format(PERSON)), ("Hello", None), ("Where?", _schema_format(POINT, "point")),
            ("Tell me more", None)]
    solo = [_reply(client, text, fmt, temperature=0).choices[0].message.content for text, fmt in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: _reply(client, a[0], a[1], temperature=0).choices[0].message.content,
                                 asks))
    assert together == solo
    jsonschema.validate(json.loads(solo[0]), PERSON)
    jsonschema.validate(json.loads(solo[2]), POINT)
    for free in (solo[1], solo[3]):
        with pytest.raises(ValueError):
            json.loads(free)  # the model alone writes noise


@pytest.mark.ranks
def test_logprobs_under_a_grammar_list_only_allowed_tokens(client: openai.OpenAI) -> None:
    reply = _reply(client, "Where?", _schema_format(POINT, "point"), temperature=0, logprobs=True, top_logprobs=5)
    entries = reply.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    assert entries[0].token == "{" and entries[0].logprob == pytest.approx(0.0, abs=1e-5)  # the only choice
    for entry in entries:
        assert entry.top_logprobs[0].token == entry.token
        assert sum(np.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-4


@pytest.mark.ranks
def test_a_schema_that_cannot_compile_is_a_400_naming_it(tiny_server: ServeProcess) -> None:
    body = {"messages": _ask("x"), "max_tokens": 4,
            "response_format": _schema_format({"type": "object", "properties": {"a": {"type": "strang"}}}, "broken")}
    r = httpx.post(f"{tiny_server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "'broken'" in error["message"] and "strang" in error["message"]
    assert httpx.get(f"{tiny_server.base}/health", timeout=10).json()["status"] == "ready"


# A reply of 800 letters and spaces (the byte tokenizer: as many tokens): long enough that the kill, sent as its first
# piece arrives, always finds it running (the client can lag seconds behind the ranks on a loaded machine).
STORY = {"type": "object", "properties": {"story": {"type": "string", "pattern": "^[a-z ]{800}$"}},
         "required": ["story"], "additionalProperties": False}


@pytest.mark.ranks
def test_a_seeded_structured_reply_resumed_after_a_killed_rank_is_the_undisturbed_one(
        tiny_server: ServeProcess, client: openai.OpenAI) -> None:
    """Last on ``tiny_server``: a sampled, seeded reply held to a JSON schema, streamed; ``kill -9`` of rank 1 after
    its first piece. The request goes on after the relaunch (its grammar state rebuilt from the reply so far,
    its random key past the draws made) and the client gets the very reply an undisturbed run gives: valid JSON."""
    from fixtures.processes import local_rank_processes

    def stream(kill_after: int | None) -> str:
        chunks = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=_ask("A story?"), max_tokens=900, temperature=1.0,
            seed=5, response_format=_schema_format(STORY, "story"), stream=True)  # type: ignore[call-overload]
        pieces = []
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == kill_after:
                    worker = next(pid for pid, (rank, cmd) in local_rank_processes(tiny_server.proc.pid).items()
                                  if rank == 1 and "mlxpipe.launch.supervisor" not in cmd)
                    os.kill(worker, signal.SIGKILL)
        return "".join(pieces)

    undisturbed = stream(None)
    jsonschema.validate(json.loads(undisturbed), STORY)
    assert stream(1) == undisturbed
    assert tiny_server.health()["restarts"] == 1  # it was resumed, not finished before the kill
    assert tiny_server.said("tokens replayed")
