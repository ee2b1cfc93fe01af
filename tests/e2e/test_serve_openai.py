"""``mlxpipe serve`` end to end: the real console script on 2 local ranks, the ``openai`` package as client.

One server (the chat model, an API key; the session's ``server`` fixture, shared with the
other test files that talk to a running server) serves every test that is not about
starting, breaking or stopping one; a second, small one is broken on purpose
(a rank killed, SIGTERM). Greedy output must equal single-process mlx-lm's,
whatever else is in flight: the main server batches up to 3 requests' decode
steps per micro-batch, so concurrent streams share batched caches.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fixtures.chat_reference import stop_in
from fixtures.faulty_worker import FAILING_SEED
from fixtures.option_reference import reference as option_reference
from fixtures.processes import local_rank_processes, tree_cpu_seconds
from fixtures.serve_process import (
    CONTEXT,
    KEY,
    ServeProcess,
    assert_drained_and_gone,
    stop_all,
    stream_through_sigterm,
)

pytestmark = pytest.mark.ranks

MAX_TOKENS = 10
LONG = 4000  # a reply the test ends first (a disconnect, a killed rank): the chat model decodes 400 tokens in seconds
DRAINED = 200  # a reply still running when SIGTERM comes (~4 s: the chat model decodes ~50 tok/s on 2 ranks)
QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "What is 2 + 2?",
    "Say hello.",
    "What is the largest planet?",
    "Name a fruit.",
    "What day comes after Monday?",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@cache
def _reference_model(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(path)


def reference(model_dir: Path, messages: list[dict[str, str]] | None = None, prompt: str | None = None,
              max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    """Single-process mlx-lm: the greedy reply's text (as ``stream_generate`` streams it) and its tokens."""
    from mlx_lm import stream_generate

    model, tokenizer = _reference_model(str(model_dir))
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    responses = list(stream_generate(model, tokenizer, tokens, max_tokens=max_tokens))
    return "".join(r.text for r in responses), [r.token for r in responses]


def _prompt_tokens(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = _reference_model(str(model_dir))[1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _stream_text(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: Any) -> tuple[str, Any, list[Any]]:
    chunks = list(client.chat.completions.create(
        model=_model_id(client), messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kwargs,
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage, chunks


@cache
def _model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# --- the API ------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, chat_model: Path) -> None:
    assert [m.id for m in client.models.list().data] == [str(chat_model)]


def test_chat_is_token_identical_to_mlx_lm(client: openai.OpenAI, chat_model: Path) -> None:
    text, tokens = reference(chat_model, _user(QUESTIONS[0]))
    reply = client.chat.completions.create(model=str(chat_model), messages=_user(QUESTIONS[0]),
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.choices[0].finish_reason == ("stop" if tokens[-1] in _eos(chat_model) else "length")
    assert reply.object == "chat.completion" and reply.model == str(chat_model)


def test_streamed_chat_matches_and_reports_usage(client: openai.OpenAI, chat_model: Path) -> None:
    text, tokens = reference(chat_model, _user(QUESTIONS[3]))
    streamed, usage, chunks = _stream_text(client, _user(QUESTIONS[3]))
    assert streamed == text
    assert usage.completion_tokens == len(tokens) and usage.prompt_tokens > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_mlx_lm(client: openai.OpenAI, chat_model: Path, stream: bool) -> None:
    prompt = "The three primary colors are"
    text, tokens = reference(chat_model, prompt=prompt)
    if stream:
        chunks = list(client.completions.create(model=str(chat_model), prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        reply = client.completions.create(model=str(chat_model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        got = reply.choices[0].text
        assert reply.usage.completion_tokens == len(tokens)
    assert got == text


def test_a_stop_string_ends_the_reply_and_is_never_shown(client: openai.OpenAI, chat_model: Path) -> None:
    text, _ = reference(chat_model, _user(QUESTIONS[0]))
    stop = stop_in(text)  # a word of mlx-lm's reply, midway
    streamed, _usage, chunks = _stream_text(client, _user(QUESTIONS[0]), stop=[stop])
    assert streamed == text[: text.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_eight_concurrent_streams_each_match_their_solo_output(client: openai.OpenAI, chat_model: Path) -> None:
    expected = [reference(chat_model, _user(q))[0] for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(lambda q: _stream_text(client, _user(q))[0], QUESTIONS))
    assert got == expected


def test_second_turn_of_a_chat_prefills_only_its_new_tokens(client: openai.OpenAI, chat_model: Path) -> None:
    first_q, second_q = "Tell me about Paris.", "And about Rome?"
    first = client.chat.completions.create(model=str(chat_model), messages=_user(first_q),
                                           max_tokens=MAX_TOKENS, temperature=0)
    history = [*_user(first_q), {"role": "assistant", "content": first.choices[0].message.content},
               *_user(second_q)]
    second = client.chat.completions.create(model=str(chat_model), messages=history,
                                            max_tokens=MAX_TOKENS, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything up to the first reply is reused; only the new turn is prefilled: the new turn, and the first
    # reply from where its text, tokenized again, parts from the tokens generated (the chat model's random words
    # seldom tokenize back the same).
    _, first_tokens = reference(chat_model, _user(first_q))
    turn = _prompt_tokens(chat_model, _user(first_q)) + first_tokens
    again = _prompt_tokens(chat_model, history)
    common = next((i for i, (a, b) in enumerate(zip(turn, again, strict=False)) if a != b), min(len(turn), len(again)))
    assert len(again) == second.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens - cached <= len(again) - common + 1  # +1: the reply's last token, never fed
    assert second.choices[0].message.content == reference(chat_model, history)[0]


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "one-body"])
def test_a_client_that_disconnects_frees_its_slot(server: ServeProcess, chat_model: Path, stream: bool) -> None:
    body = {"model": str(chat_model), "messages": _user("Write a long story about a dragon."),
            "max_tokens": LONG, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}"}
    if stream:
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, headers=headers, timeout=60) as response:
            lines = response.iter_lines()
            assert any(line.startswith("data: ") and "content" in line for line in lines)
    else:
        # The client gives up (its read timeout) long before LONG tokens are ready, and closes the connection.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/chat/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=2))
    deadline = time.monotonic() + 30
    while server.health()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.health()["in_flight"] == 0
    log = _request_log(server)
    assert log[-1]["status"] == "cancelled" and log[-1]["generation_tokens"] < LONG


# A body per option (mlx_lm.server's names), and the same request in Request's fields for mlx-lm.
OPTION_BODIES = {
    "top_k": ({"temperature": 1.0, "top_k": 3, "seed": 5}, {"temp": 1.0, "top_k": 3, "seed": 5}),
    "xtc": ({"temperature": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.02, "seed": 6},
            {"temp": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.02, "seed": 6}),
    "logit_bias": ({"logit_bias": {"338": 6.0, "314": 4.0}}, {"logit_bias": {"338": 6.0, "314": 4.0}}),
    # The chat model's random words never repeat on their own: for the penalties a bias makes it say token 338 again
    # and again, and the penalty is what differs from that (the bias is kept in the check that the option changes
    # something).
    "repetition_penalty": ({"repetition_penalty": 2.0, "repetition_context_size": 12, "logit_bias": {"338": 3.0}},
                           {"repetition_penalty": 2.0, "repetition_context_size": 12, "logit_bias": {"338": 3.0}}),
    "presence_frequency": ({"presence_penalty": 2.0, "frequency_penalty": 1.0, "logit_bias": {"338": 3.0}},
                           {"presence_penalty": 2.0, "frequency_penalty": 1.0, "logit_bias": {"338": 3.0}}),
}


def test_each_body_option_is_token_identical_to_mlx_lm(client: openai.OpenAI, chat_model: Path) -> None:
    """One request per option against the shared server, all at once, each as mlx-lm alone with that option."""
    messages = _user(QUESTIONS[1])

    def ask(body: dict[str, Any]) -> Any:
        return client.chat.completions.create(model=str(chat_model), messages=messages, max_tokens=MAX_TOKENS,
                                              extra_body=body, logprobs=None)

    with ThreadPoolExecutor(len(OPTION_BODIES)) as pool:
        replies = dict(zip(OPTION_BODIES, pool.map(ask, [body for body, _ in OPTION_BODIES.values()]), strict=True))
    for option, (_, fields) in OPTION_BODIES.items():
        request = {"messages": messages, "max_tokens": MAX_TOKENS}
        _, text = option_reference(chat_model, {**request, **fields})
        assert replies[option].choices[0].message.content == text, option
        without = {k: v for k, v in fields.items() if k in ("temp", "seed") or (k == "logit_bias" and option != k)}
        assert text != option_reference(chat_model, {**request, **without})[1], f"{option} changes nothing here"


def test_context_bounds_the_prompt(server: ServeProcess) -> None:
    body = {"messages": _user("word " * (CONTEXT + 100))}  # over --context, within the model's 8192 positions
    response = httpx.post(f"{server.url}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # OpenAI's words, with both counts: what agents act on.
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert int(error["message"].split("resulted in ")[1].split()[0]) > CONTEXT


BAD = [
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "other/model"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "xtc_threshold": 0.9}, 400, "xtc_threshold"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": [1]}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": "high"}, 400, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"}], "num_draft_tokens": 0}, 400, "num_draft_tokens"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_is_a_4xx_naming_the_field(server: ServeProcess, body: dict[str, Any], status: int,
                                              param: str) -> None:
    since = len(server.err)
    response = httpx.post(f"{server.url}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"]
    assert server.health()["status"] == "ready"
    assert server.said(f"refused POST /v1/chat/completions (openai): {status} '{param}'", since)


@pytest.mark.parametrize(("raw", "fragment"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object")])
def test_a_body_that_is_not_a_json_object_is_refused(server: ServeProcess, raw: bytes, fragment: str) -> None:
    since = len(server.err)
    response = httpx.post(f"{server.url}/chat/completions", content=raw,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert fragment in server.said("refused POST /v1/chat/completions (openai): 400", since)


def test_a_body_over_the_limit_is_refused(server: ServeProcess) -> None:
    # 60 MB: the client is still sending when the server has decided; it must read a 413, not a reset.
    since = len(server.err)
    response = httpx.post(f"{server.url}/chat/completions", content=b"x" * (60 * 1024 * 1024),
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "--max-body-size" in error["message"]
    assert "--max-body-size" in server.said("refused POST /v1/chat/completions (openai): 413", since)


# --- no body can break the server -------------------------------------------------------------

_JUNK: list[Any] = [None, True, 0, -1, 1, 2**31, 2**63, 2**70, -2**70, 1e308, -1e308, 0.5, "NaN", "Infinity", "",
                    "x" * 2000, [], [1], {}, {"a": 1}, [[[]]], "🦄\u0000", {"type": "text"}, [{"role": None}]]
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p",
           "top_k", "seed", "n", "stream", "stream_options", "stop", "tools", "logit_bias", "repetition_penalty",
           "repetition_context_size", "presence_penalty", "presence_context_size", "frequency_penalty",
           "frequency_context_size", "xtc_probability", "xtc_threshold", "min_tokens_to_keep", "chat_template_kwargs",
           "num_draft_tokens"]
_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _fuzz_bodies(count: int = 200, seed: int = 20) -> list[tuple[str, bytes]]:
    """``count`` malformed or odd bodies (path, raw body), the same every run."""
    rng = random.Random(seed)
    raw_ok = json.dumps(_OK).encode()
    bodies: list[tuple[str, bytes]] = []
    for i in range(count):
        body: dict[str, Any] = dict(_OK)
        kind = i % 8
        if kind in (0, 1):  # one field of the wrong type, shape or size
            body[rng.choice(_FIELDS)] = rng.choice(_JUNK)
        elif kind == 2:  # several at once
            for field in rng.sample(_FIELDS, 4):
                body[field] = rng.choice(_JUNK)
        elif kind == 3:  # messages of every wrong shape
            body["messages"] = [{"role": rng.choice(_JUNK), "content": rng.choice(_JUNK)}
                                for _ in range(rng.randint(0, 3))]
        elif kind == 4:  # huge lists
            field, value = rng.choice([("stop", ["s"] * 1000), ("logit_bias", {str(t): 1 for t in range(5000)}),
                                       ("tools", [{"type": "function"}] * 1000),
                                       ("messages", [{"role": "user", "content": "hi"}] * 3000)])
            body[field] = value
        elif kind == 5:  # cut, empty, not UTF-8, not JSON at all, nested beyond reason
            raw = rng.choice([raw_ok[: rng.randint(0, len(raw_ok) - 1)], b"", b"\xff\xfe\xfa{", b"null", b"[]",
                              b"[" * 100000, raw_ok.replace(b"2}", b"NaN}"), raw_ok.replace(b"2}", b"1e999}")])
            bodies.append(("/chat/completions", raw))
            continue
        elif kind == 6:  # the completions endpoint
            body = {"prompt": rng.choice(_JUNK + ["hi"]), "max_tokens": rng.choice([1, 2, -5, 2**70, "2"]),
                    rng.choice(_FIELDS): rng.choice(_JUNK)}
            bodies.append(("/completions", json.dumps(body).encode()))
            continue
        else:  # numbers at the edges of each range (a legal max_tokens stays small: a long reply only takes time)
            field = rng.choice(_FIELDS[3:])
            edges = [0, 1, -1, 1.0, 2**31, 2**64] if "max" in field else [0, 1, -1, 0.0, 1.0, 101, -101, 2**31 - 1,
                                                                          2**64, 1e-308]
            body[field] = rng.choice(edges)
        bodies.append(("/chat/completions", json.dumps(body).encode()))
    return bodies


def test_no_body_breaks_the_server(server: ServeProcess, client: openai.OpenAI, chat_model: Path) -> None:
    """Hundreds of malformed bodies, while greedy requests run: each gets a 4xx JSON error or a legal 2xx, never a
    5xx; the greedy replies stay mlx-lm's, and the pipeline never restarts."""
    expected = [reference(chat_model, _user(q))[0] for q in QUESTIONS[:3]]
    greedy: list[str] = []
    runner = threading.Thread(target=lambda: greedy.extend(_stream_text(client, _user(q))[0] for q in QUESTIONS[:3]))
    runner.start()

    # One client for every body: making one per request (httpx.post) cost 60 ms of CPU each, 12 s in all.
    http = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})

    def send(item: tuple[str, bytes]) -> tuple[int, str]:
        path, raw = item
        response = http.post(f"{server.url}{path}", content=raw)
        if 400 <= response.status_code < 500:  # OpenAI's error shape, with a message
            assert response.json()["error"]["message"], response.text
        elif response.status_code == 200 and not response.text.startswith("data: "):
            assert response.json()["choices"], response.text
        return response.status_code, f"{raw[:150]!r} -> {response.text[:300]}"

    with http, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, _fuzz_bodies()))
    runner.join(timeout=300)
    assert [a for a in answers if a[0] >= 500 or a[0] < 200] == []
    assert sum(status == 200 for status, _ in answers) > 10  # the legal ones did run
    assert greedy == expected
    health = server.health()
    assert (health["status"], health["restarts"]) == ("ready", 0)


def test_a_client_that_leaves_while_sending_its_body_is_one_quiet_line(server: ServeProcess) -> None:
    before = len(server.err)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n{\"messages\":")
    deadline = time.monotonic() + 10
    while len(server.err) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    new = "".join(server.err[before:])
    assert "went away" in new and "Traceback" not in new, new
    assert server.health()["status"] == "ready"


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}"])
def test_every_endpoint_but_health_needs_the_key(server: ServeProcess, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    since = len(server.err)
    assert httpx.get(f"{server.url}/models", headers=headers).status_code == 401
    assert "invalid or missing API key" in server.said("refused GET /v1/models (openai): 401", since)
    response = httpx.post(f"{server.url}/chat/completions", headers=headers, json={"messages": _user("hi")})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_health_names_every_rank(server: ServeProcess, chat_model: Path) -> None:
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.model.metadata import load_local
    from mlxpipe.plan.shard import make_plan

    the_plan = make_plan(load_local(chat_model), load_hostfile(Path("hostfiles/local-2.json")).hosts)
    health = server.health()
    assert health["status"] == "ready"
    assert [(r["rank"], r["layers"], r["state"]) for r in health["ranks"]] == [
        (r.rank, [r.start, r.end], "ready") for r in the_plan.ranks
    ]
    # The demo model's own default split (15, 15): tests/plan/test_demo_split.py, without ranks.


def test_an_idle_server_leaves_the_cores_alone(server: ServeProcess) -> None:
    # mlx.launch's I/O threads, unpatched, spin a core per rank for as long as the ranks run (launch/mlx_launch.py):
    # over 3 s idle, that is 3 s of CPU or more (a core at least, however loaded the machine). Patched, the server,
    # mlx.launch, the supervisors and the ranks together use a few hundredths of a second. Run first in its module,
    # the server is still settling after start-up for a window or so (0.9-1 s measured): the quietest of three
    # windows counts, which the spin never brings under 3 s.
    used = []
    for _ in range(3):
        before = tree_cpu_seconds(server.proc.pid)
        time.sleep(3)
        used.append(tree_cpu_seconds(server.proc.pid) - before)
        if used[-1] < 0.9:
            break
    assert min(used) < 0.9, f"the idle server's processes used {used} s of CPU in windows of 3 s"


def test_health_says_where_the_time_goes(server: ServeProcess, client: openai.OpenAI) -> None:
    _stream_text(client, _user(QUESTIONS[1]))  # a request has ended: every rank has reported
    health = server.health()
    assert health["decode_batch"] == 3
    spent = health["time"]
    assert [r["rank"] for r in spent["ranks"]] == [0, 1]
    assert all(0 < r["busy"] <= 1 and r["compute_s"] > 0 for r in spent["ranks"])
    assert [(h["from"], h["to"]) for h in spent["hops"]] == [(1, 0)] and spent["hops"][0]["wait_s"] >= 0
    assert spent["ranks"][1]["recv_s"] == 0  # the first stage receives from nobody
    assert spent["busiest_rank"] in (0, 1)
    # The request log carries each rank's busy fraction as of each request's end.
    busy = [record["busy"] for record in _request_log(server)]
    assert any(len(b) == 2 for b in busy) and all(0 < x <= 1 for b in busy for x in b)


def test_no_traceback_and_no_asyncio_noise_in_the_servers_output(server: ServeProcess) -> None:
    # Every test above used this server: disconnects at every moment, malformed bodies, a 60 MB body.
    assert "Traceback" not in server.stderr and "socket.send() raised exception" not in server.stderr, server.stderr


def test_the_key_appears_in_no_log_and_no_command_line(server: ServeProcess) -> None:
    assert KEY not in server.stderr
    for _, cmdline in local_rank_processes(server.proc.pid).values():
        assert KEY not in cmdline
    for path in _run_dir(server).rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="replace")


# --- a server broken on purpose -------------------------------------------------------------


@pytest.fixture(scope="module")
def fragile(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(["--model", str(chat_model), "--hostfile", "hostfiles/local-2.json",
                         "--max-concurrency", "1", "--max-queue", "0", "--max-restarts", "2"],
                        tmp_path_factory.mktemp("fragile-home"))
    try:
        # A request sent the moment the server listens, the ranks still loading: it waits for them.
        assert proc.wait_listening()["status"] == "loading"
        proc.first_reply = ThreadPoolExecutor(1).submit(_ask, proc.url, QUESTIONS[1])
        proc.wait_for("ready")
        yield proc
    finally:
        stop_all(proc)


def _ask(url: str, question: str, temperature: float = 0, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(model=_model_id(client), messages=_user(question), max_tokens=MAX_TOKENS,
                                          temperature=temperature, **kwargs)


def test_a_request_sent_while_the_ranks_load_is_answered_once_they_are_ready(fragile: ServeProcess,
                                                                              chat_model: Path) -> None:
    reply = fragile.first_reply.result(timeout=300)
    assert reply.choices[0].message.content == reference(chat_model, _user(QUESTIONS[1]))[0]


def test_beyond_concurrency_and_queue_the_answer_is_429(fragile: ServeProcess, chat_model: Path) -> None:
    body = {"model": str(chat_model), "messages": _user("Write a long story."), "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{fragile.url}/chat/completions", json=body, timeout=60) as first:
        lines = first.iter_lines()  # kept: a dropped iterator would close the stream (a disconnect)
        next(line for line in lines if "content" in line)
        second = httpx.post(f"{fragile.url}/chat/completions", json={**body, "stream": False}, timeout=30)
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["type"] == "rate_limit_error"


# What the server names as the failure when rank 1's worker gets the signal: killed, or stopped (a hung process:
# its supervisor kills it after 5 s without a word).
SIGNALLED = {
    signal.SIGKILL: "rank 1 on 127.0.0.1: killed by SIGKILL (exit status -9)",
    signal.SIGSTOP: "rank 1 on 127.0.0.1: its worker stopped answering: no word from it for 5 s, though its host "
                    "still answers; it was killed",
}


# A reply long enough that the signal, sent as its first text arrives, always finds it running: the client can lag
# seconds behind the ranks on a loaded machine (200 tokens were all made before the 20th reached the client once).
RESUMED = 600


@cache
def _story(model_dir: Path) -> str:
    return reference(model_dir, _user("Write a long story."), max_tokens=RESUMED)[0]


@pytest.mark.parametrize("sig", list(SIGNALLED), ids=["kill", "stop"])
def test_a_failed_rank_pauses_the_stream_which_goes_on_as_mlx_lms_reply(fragile: ServeProcess, chat_model: Path,
                                                                      sig: signal.Signals) -> None:
    """``kill -9`` or ``kill -STOP`` of rank 1 as the stream's first text comes: the pipeline relaunches and the
    request goes on where its client left off. The client sees a pause, never an error: its text is mlx-lm's greedy
    reply, whole, and the server's line for the request names the failure, the pause and the tokens replayed."""
    restarts = fragile.health()["restarts"]
    messages = _user("Write a long story.")
    client = openai.OpenAI(base_url=fragile.url, api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=str(chat_model), messages=messages, max_tokens=RESUMED,
                                            stream=True)
    chunks = iter(stream)
    texts = [c.choices[0].delta.content for c in itertools.islice(
        (c for c in chunks if c.choices and c.choices[0].delta.content), 1)]
    worker = next(pid for pid, (rank, cmd) in local_rank_processes(fragile.proc.pid).items()
                  if rank == 1 and "mlxpipe.launch.supervisor" not in cmd)
    signal_pid(worker, sig)
    rest = list(chunks)  # an error would raise here
    texts += [c.choices[0].delta.content or "" for c in rest if c.choices]
    assert "".join(texts) == _story(chat_model)
    assert rest[-1].choices[0].finish_reason == "length"
    assert fragile.health()["restarts"] == restarts + 1  # it was resumed, not finished before the signal
    record = next(r for r in reversed(_request_log(fragile)) if "resumed" in r)
    (resumed,) = record["resumed"]
    assert resumed["after"] == SIGNALLED[sig]
    assert 1 <= resumed["replayed"] < RESUMED and resumed["pause"] > 0
    assert (record["status"], record["generation_tokens"]) == ("length", RESUMED)
    assert any(f"resumed after {resumed['after']}: paused" in line and "tokens replayed" in line
               for line in fragile.err), fragile.stderr


def test_after_its_last_restart_the_server_exits_1_with_the_root_cause(fragile: ServeProcess) -> None:
    """Last on ``fragile``: its two restarts spent (the failed ranks above), a third failure ends the server."""
    assert fragile.health()["restarts"] == 2
    worker = next(pid for pid, (rank, cmd) in local_rank_processes(fragile.proc.pid).items()
                  if rank == 0 and "mlxpipe.launch.supervisor" not in cmd)
    signal_pid(worker, signal.SIGKILL)
    code = fragile.proc.wait(timeout=60)
    assert code == 1, fragile.stderr
    fragile.stop()  # the stderr reader, to its end
    errors = [line for line in fragile.err if line.startswith("error: ")]
    assert errors == ["error: the pipeline failed 3 times, the last time: rank 0 on 127.0.0.1: "
                      "killed by SIGKILL (exit status -9)\n"], fragile.stderr


# --- a server whose rank 0 fails one request on purpose ------------------------------------------


@pytest.fixture(scope="module")
def faulty(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    script = Path(__file__).parents[1] / "fixtures" / "faulty_serve.py"
    # --drain-seconds: far longer than the drained reply takes on a loaded machine (7 tok/s seen).
    proc = ServeProcess(["--model", str(chat_model), "--queue-timeout", "1", "--drain-seconds", "120"],
                        tmp_path_factory.mktemp("faulty-home"),
                        command=[sys.executable, str(script)])
    try:
        proc.wait_listening()
        # Sent at once, with a queue timeout far below the ranks' load time: it gets a 503 that says why.
        proc.too_early = httpx.post(f"{proc.url}/chat/completions", json={"messages": _user("hi")}, timeout=60)
        proc.wait_for("ready")
        yield proc
    finally:
        stop_all(proc)


def test_a_request_that_waits_beyond_the_queue_timeout_gets_a_503_saying_why(faulty: ServeProcess) -> None:
    response = faulty.too_early
    assert response.status_code == 503, response.text
    assert "waited 1 s for the pipeline, which is still loading" in response.json()["error"]["message"]


def test_a_request_whose_sampler_fails_ends_alone(faulty: ServeProcess, chat_model: Path) -> None:
    """One request's logits processor raises on rank 0 while two others are in flight: it gets an error naming the
    cause, the others mlx-lm's tokens, and the pipeline does not restart."""
    def failing() -> Any:
        with pytest.raises(openai.InternalServerError) as e:
            _ask(faulty.url, QUESTIONS[2], temperature=0.7, seed=FAILING_SEED)
        return e.value

    with ThreadPoolExecutor(3) as pool:
        fine = [pool.submit(_ask, faulty.url, q) for q in QUESTIONS[:2]]
        error = pool.submit(failing).result(timeout=300)
        replies = [f.result(timeout=300) for f in fine]
    assert "a logits processor failed on purpose" in str(error) and "rank 0" in str(error)
    assert [r.choices[0].message.content for r in replies] == [reference(chat_model, _user(q))[0]
                                                               for q in QUESTIONS[:2]]
    health = faulty.health()
    assert (health["status"], health["restarts"]) == ("ready", 0)
    assert any(r["status"] == "error" and "failed on purpose" in r["error"] for r in _request_log(faulty))


def test_sigterm_drains_then_stops_every_rank_and_exits_143(faulty: ServeProcess, chat_model: Path) -> None:
    """Last on ``faulty`` (the real server, ``serve.server.serve``, with the faulty worker in its ranks): SIGTERM
    with a stream in flight. New requests get a 503 with Retry-After while the stream runs to its end, mlx-lm's
    reply whole; then the server stops, and every rank with it."""
    pids = set(local_rank_processes(faulty.proc.pid))
    assert pids
    messages = _user("Write a long story.")
    body = {"model": str(chat_model), "messages": messages, "max_tokens": DRAINED, "stream": True}
    chunks = stream_through_sigterm(faulty, body, {}, lambda: [
        httpx.post(f"{faulty.url}/chat/completions", json={**body, "stream": False}, timeout=30)])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == reference(chat_model, messages, max_tokens=DRAINED)[0]
    assert_drained_and_gone(faulty, pids)


# --- helpers ------------------------------------------------------------------------------------


def signal_pid(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _run_dir(server: ServeProcess) -> Path:
    line = [x for x in server.err if "ready" in x and "logs: " in x][-1]  # the latest launch's (after a restart)
    return Path(line.split("logs: ", 1)[1].strip())


def _request_log(server: ServeProcess) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (_run_dir(server) / "requests.jsonl").read_text().splitlines()]


@cache
def _eos(model_dir: Path) -> frozenset[int]:
    return frozenset(_reference_model(str(model_dir))[1].eos_token_ids)
