"""serve/app.py: the HTTP app over a scripted queue, in-process: the doors' routes behind the key, unknown routes,
every refusal said in the server's output and the request log, the names the model answers to, what agents
send taken in every door, a prompt over the context in each door's words.

(``/health`` asks the queue for more than the scripted queue has; a real server answers it in
``tests/e2e/test_serve_openai.py``.)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.serve_process import KEY
from mlxpipe.errors import LaunchError, RequestFailed
from mlxpipe.protocol.request import Request
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog
from mlxpipe.serve.stream import Outcome, Stream


@pytest.fixture(scope="module")
def http(demo_model: Path) -> Iterator[TestClient]:
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096)
    app = build_app(ScriptedQueue(tokenizer, "Paris."), tokenizer, settings, RequestLog())  # type: ignore[arg-type]
    with TestClient(app) as client:
        yield client


def test_an_unknown_route_or_method_is_an_error_in_openais_shape(http: TestClient) -> None:
    missing = http.get("/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route GET /v2/nothing"
    wrong = http.get("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "GET is not allowed on /v1/chat/completions"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"max_tokens": 8, "messages": [{"role": "user", "content": "Capital of France?"}]}),
    ("/v1/completions", {"max_tokens": 8, "prompt": "Capital of France?"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Capital of France?"}]}),
    ("/v1/responses", {"input": "Capital of France?"}),
    ("/api/chat", {"messages": [{"role": "user", "content": "Capital of France?"}], "stream": False}),
    ("/api/generate", {"prompt": "Capital of France?", "stream": False}),
])
def test_every_door_is_routed_and_behind_the_key(http: TestClient, path: str, body: dict[str, object]) -> None:
    assert http.post(path, json=body).status_code in (401, 403)
    response = http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}", "x-api-key": KEY})
    assert response.status_code == 200, response.text
    assert "Paris." in response.text  # the scripted queue's reply, in the door's own shape


class TroubledQueue(ScriptedQueue):
    """A scripted queue that is ``full`` (no room: 429), ``down`` (the pipeline gave up: 503) or ``failing`` (the
    request fails at its first token: 500), as ``trouble`` says; else it replies."""

    trouble: str | None = None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Stream:
        if self.trouble == "down":
            raise LaunchError("rank 1 on host-b: killed by SIGKILL")
        if self.trouble == "failing":
            stream = Stream(request, loop)
            stream.put(Outcome(error=RequestFailed("its sampler raised on rank 0")))
            return stream
        return super().submit(request, loop)

    @property
    def in_flight(self) -> int:
        return self.capacity if self.trouble == "full" else 0

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        pass


@pytest.fixture(scope="module")
def troubled(demo_model: Path) -> Iterator[tuple[TestClient, TroubledQueue, RequestLog]]:
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096, max_body_bytes=1024,
                              served_names=("local-model",))
    queue, log = TroubledQueue(tokenizer, "Paris."), RequestLog()
    with TestClient(build_app(queue, tokenizer, settings, log)) as client:  # type: ignore[arg-type]
        yield client, queue, log


_AUTH = {"Authorization": f"Bearer {KEY}"}
_DOORS = {"/v1/chat/completions": ("openai", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}),
          "/v1/completions": ("openai", {"max_tokens": 8, "prompt": "Hi"}),
          "/v1/messages": ("anthropic", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}),
          "/v1/messages/count_tokens": ("anthropic", {"messages": [{"role": "user", "content": "Hi"}]}),
          "/v1/responses": ("responses", {"input": "Hi"}),
          "/api/chat": ("ollama", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
          "/api/generate": ("ollama", {"prompt": "Hi", "stream": False})}
# What each way of refusing a request sends: its headers, its raw body or a change to a good one, what the queue does.
_REFUSALS: dict[str, tuple[int, dict[str, str], Any, str | None]] = {
    "no key": (401, {}, None, None),
    "too large": (413, _AUTH, b"x" * 4096, None),
    "not json": (400, _AUTH, b"{not json", None),
    "bad field": (400, _AUTH, {"temperature": "hot", "options": {"temperature": "hot"}}, None),
    "unknown model": (404, _AUTH, {"model": "gpt-other"}, None),
    "no room": (429, _AUTH, {}, "full"),
    "pipeline down": (503, _AUTH, {}, "down"),
}


@pytest.mark.parametrize(("path", "way"), [(p, w) for p in _DOORS for w in _REFUSALS
                                           if not (p.endswith("count_tokens") and _REFUSALS[w][3])])  # no rank there
def test_every_refusal_is_one_line_and_one_record_naming_door_status_and_reason(
        troubled: tuple[TestClient, TroubledQueue, RequestLog], capsys: pytest.CaptureFixture[str], path: str,
        way: str) -> None:
    client, queue, log = troubled
    door, good = _DOORS[path]
    status, headers, change, trouble = _REFUSALS[way]
    body = change if isinstance(change, bytes) else {**good, **(change or {})}
    if way == "bad field" and path.startswith("/api/"):
        body.pop("temperature")
    capsys.readouterr()
    queue.trouble = trouble
    try:
        response = (client.post(path, content=body, headers=headers) if isinstance(body, bytes) else
                    client.post(path, json=body, headers=headers))
    finally:
        queue.trouble = None
    assert response.status_code == status, response.text
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"refused POST {path} ({door}): {status}"), line
    record = log.figures()[0][0]
    assert (record["door"], record["path"], record["status"]) == (door, path, str(status)) and record["error"]
    assert record["error"][:50] in line


@pytest.mark.parametrize("path", [p for p in _DOORS if not p.endswith("count_tokens")])
def test_a_request_that_fails_at_its_first_token_is_its_own_one_line(
        troubled: tuple[TestClient, TroubledQueue, RequestLog], capsys: pytest.CaptureFixture[str], path: str) -> None:
    client, queue, log = troubled
    door, body = _DOORS[path]
    capsys.readouterr()
    queue.trouble = "failing"
    try:
        response = client.post(path, json=body, headers=_AUTH)
    finally:
        queue.trouble = None
    assert response.status_code == 500
    [line] = capsys.readouterr().err.splitlines()  # the request's own line: not a second one for the refusal
    assert f" ({door}): error, " in line and line.endswith("; error: its sampler raised on rank 0"), line
    assert log.figures()[0][0]["status"] == "error"


@pytest.mark.parametrize(("method", "path", "status", "door"), [
    ("GET", "/v2/nothing", 404, "http"), ("GET", "/v1/chat/completions", 405, "http"),
    ("GET", "/v1/models", 401, "openai"), ("GET", "/api/tags", 401, "ollama"), ("GET", "/v1/cluster", 401, "page"),
    ("GET", "/v1/responses/resp_unknown", 404, "responses"),
])
def test_refusals_outside_the_generating_routes_are_said_too(
        troubled: tuple[TestClient, TroubledQueue, RequestLog], capsys: pytest.CaptureFixture[str], method: str,
        path: str, status: int, door: str) -> None:
    client = troubled[0]
    capsys.readouterr()
    headers = _AUTH if status != 401 else {}
    assert client.request(method, path, headers=headers).status_code == status
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"refused {method} {path} ({door}): {status}"), line


def test_the_page_s_recent_requests_list_refused_ones_with_why(
        troubled: tuple[TestClient, TroubledQueue, RequestLog]) -> None:
    client, _, log = troubled
    client.post("/v1/messages", json={"max_tokens": 8, "messages": [{"role": "robot"}]}, headers=_AUTH)
    requests, totals = log.figures()  # what /v1/cluster gives the page (a real queue's in tests/e2e/test_page.py)
    newest = requests[0]
    assert (newest["id"], newest["door"], newest["status"], newest["param"]) == (None, "anthropic", "400",
                                                                                 "messages[0]")
    assert newest["prompt_tokens"] == 0 and newest["ttft"] is None and totals["refused"] >= 1


def test_the_model_is_listed_under_each_name_and_answers_to_each(
        troubled: tuple[TestClient, TroubledQueue, RequestLog]) -> None:
    client = troubled[0]
    assert [m["id"] for m in client.get("/v1/models", headers=_AUTH).json()["data"]] == ["scripted", "local-model"]
    assert [m["name"] for m in client.get("/api/tags", headers=_AUTH).json()["models"]] == ["scripted", "local-model"]
    reply = client.post("/v1/chat/completions", headers=_AUTH, json={"model": "local-model", "max_tokens": 8,
                                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200 and reply.json()["model"] == "local-model"  # the name asked, echoed
    reply = client.post("/api/chat", headers=_AUTH, json={"model": "local-model:latest", "stream": False,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200



# What coding agents add to a plain body in each door (Claude Code, Codex, and what OpenAI's and Ollama's clients
# send): a system turn in mid-conversation, fields only the APIs' own servers act on, hosted tools, a reply longer
# than the context leaves. Each is taken (200), not refused.
_SYSTEM_LATE = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Capital of France?"}]
_AGENT_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions?beta=true": {
        "model": "scripted", "max_tokens": 64000, "messages": [{"role": "developer", "content": "Be brief."},
                                                                *_SYSTEM_LATE],
        "store": False, "metadata": {"session": "s1"}, "prompt_cache_key": "conv-1", "user": "me",
        "service_tier": "auto", "parallel_tool_calls": True, "reasoning_effort": "low",
        "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
                  {"type": "custom", "custom": {"name": "apply_patch"}}],
        "web_search_options": {}},
    "/v1/messages?beta=true": {
        "model": "claude-haiku-4-5", "max_tokens": 32000, "stream": False,
        "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral",
                                                                                                  "ttl": "1h"}}]},
                     {"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Capital of France?"}],
        "thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "medium"}, "metadata": {"user_id": "u1"}, "service_tier": "auto",
        "tools": [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
    "/v1/responses?beta=true": {
        "model": "gpt-5-codex", "max_output_tokens": 64000, "instructions": "You are an agent.",
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                   "text": "Capital of France?"}]}],
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "conv-1",
        "client_metadata": {"x-codex-turn": "1"}, "metadata": {"session": "s1"}, "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "summary": "auto"}, "text": {"verbosity": "low"}, "stream": False,
        "tools": [{"type": "function", "name": "shell_command", "parameters": {"type": "object"}},
                  {"type": "namespace", "name": "mcp__fs", "tools": [
                      {"type": "function", "name": "read", "parameters": {"type": "object"}}]},
                  {"type": "web_search", "external_web_access": False}]},
    "/api/chat?beta=true": {
        "model": "anything:latest", "stream": False, "think": False, "keep_alive": "5m",
        "options": {"num_predict": 64000, "num_ctx": 65536}, "messages": _SYSTEM_LATE},
}


@pytest.fixture(scope="module")
def agents_app(demo_model: Path) -> Iterator[tuple[TestClient, ScriptedQueue]]:
    """The scripted app as agents meet it: any model name answered (--any-model-name)."""
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096, any_model_name=True)
    queue = ScriptedQueue(tokenizer, "Paris.")
    with TestClient(build_app(queue, tokenizer, settings, RequestLog())) as client:  # type: ignore[arg-type]
        yield client, queue


@pytest.mark.parametrize("path", list(_AGENT_BODIES))
def test_every_door_takes_what_agents_send(agents_app: tuple[TestClient, ScriptedQueue],
                                           capsys: pytest.CaptureFixture[str], path: str) -> None:
    client, queue = agents_app
    capsys.readouterr()
    response = client.post(path, json=_AGENT_BODIES[path], headers={**_AUTH, "x-api-key": KEY,
                                                                    "anthropic-beta": "context-management-2025-06-27",
                                                                    "anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    assert "Paris." in response.text
    sent = queue.requests[-1]
    assert sent.tokens and sent.max_tokens == 4096 - len(sent.tokens)  # clamped to what the context leaves
    shown = queue.tokenizer.decode(sent.tokens)
    assert "Be brief." in shown and "Capital of France?" in shown  # the late system turn reached the template
    [line] = [line for line in capsys.readouterr().err.splitlines() if "tok/s" in line]
    assert " -> " in line and ": what the context (4096) leaves" in line, line  # the clamp, said


# A prompt over the context is a 400 in each door's own shape with both counts: the error agents act on (Claude Code
# compacts on Anthropic's "prompt is too long").
_LONG = "word " * 200
_TOO_LONG: dict[str, tuple[dict[str, Any], str]] = {
    "/v1/chat/completions": ({"max_tokens": 8, "messages": [{"role": "user", "content": _LONG}]},
                             "maximum context length is 64 tokens. However, your messages resulted in"),
    "/v1/completions": ({"max_tokens": 8, "prompt": _LONG}, "maximum context length is 64 tokens."),
    "/v1/messages": ({"max_tokens": 8, "messages": [{"role": "user", "content": _LONG}]}, "prompt is too long: "),
    "/v1/messages/count_tokens": ({"messages": [{"role": "user", "content": _LONG}]}, "prompt is too long: "),
    "/v1/responses": ({"input": _LONG}, "maximum context length is 64 tokens."),
    "/api/chat": ({"messages": [{"role": "user", "content": _LONG}], "stream": False},
                  "maximum context length is 64 tokens."),
    "/api/generate": ({"prompt": _LONG, "stream": False}, "maximum context length is 64 tokens."),
}


@pytest.fixture(scope="module")
def narrow(demo_model: Path) -> Iterator[TestClient]:
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=64)
    app = build_app(ScriptedQueue(tokenizer, "Paris."), tokenizer, settings, RequestLog())  # type: ignore[arg-type]
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("path", list(_TOO_LONG))
def test_a_prompt_over_the_context_is_a_400_with_both_counts_in_each_door_s_shape(narrow: TestClient,
                                                                                 path: str) -> None:
    body, words = _TOO_LONG[path]
    response = narrow.post(path, json=body, headers={**_AUTH, "x-api-key": KEY})
    assert response.status_code == 400, response.text
    reply = response.json()
    error = reply["error"]
    if path.startswith("/api/"):  # Ollama's shape: the message alone
        message = error
    elif path.startswith("/v1/messages"):  # Anthropic's: the type, and the message
        assert reply["type"] == "error" and error["type"] == "invalid_request_error"
        message = error["message"]
    else:  # OpenAI's: the message, its code and the field
        assert error["code"] == "context_length_exceeded" and error["param"] in ("messages", "prompt", "input")
        message = error["message"]
    assert words in message, message
    counts = [int(n) for n in re.findall(r"\d+", message)]
    assert 64 in counts and any(n > 64 for n in counts), message  # both counts: the context, and the prompt's


class BrokenQueue(ScriptedQueue):
    """A queue with a bug: its ``submit`` raises what no door expects."""

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Stream:
        raise RuntimeError("a bug in the queue")


def test_a_bug_in_the_server_is_a_500_and_one_line_too(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="scripted", api_key=KEY, context=4096)
    log = RequestLog()
    app = build_app(BrokenQueue(tokenizer, "Paris."), tokenizer, settings, log)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        capsys.readouterr()
        response = client.post("/v1/chat/completions", headers=_AUTH,
                               json={"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "the server failed: RuntimeError: a bug in the queue"
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("refused ")]
    assert line == "refused POST /v1/chat/completions (http): 500: the server failed: RuntimeError: a bug in the queue"
    assert log.figures()[0][0]["status"] == "500"
