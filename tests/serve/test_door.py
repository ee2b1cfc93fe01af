"""serve/door.py: the names a model answers to, a context too small for the prompt, a refusal said once."""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
from starlette.requests import Request

from mlxpipe.serve.door import ApiError, ContextTooLong, ServerSettings, admit, refused
from mlxpipe.serve.queue import RequestLog


def _http(method: str = "POST", path: str = "/v1/messages") -> Request:
    return Request({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""})


def test_a_model_answers_to_its_id_and_aliases_and_lists_them() -> None:
    settings = ServerSettings(model_id="/models/big", api_key=None, context=8, served_names=("big", "/models/big"))
    assert settings.model_names == ("/models/big", "big")
    assert settings.answers_to("big") and settings.answers_to("/models/big")
    assert not settings.answers_to("claude-opus-4-8")


def test_any_model_name_answers_every_name_and_says_each_new_one_once(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ServerSettings(model_id="big", api_key=None, context=8, any_model_name=True)
    assert all(settings.answers_to(name) for name in ("claude-opus-4-8", "gpt-6.1-sol", "claude-opus-4-8", "big"))
    said = capsys.readouterr().err.splitlines()
    assert said == ["model name 'claude-opus-4-8' answered by big (--any-model-name)",
                    "model name 'gpt-6.1-sol' answered by big (--any-model-name)"]
    assert settings.model_names == ("big",)  # listed: only the names it was given


def test_a_prompt_over_the_context_has_both_counts_in_openais_words() -> None:
    error = ContextTooLong(9000, 8192, "messages")
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert error.message == ("This model's maximum context length is 8192 tokens. However, your messages resulted "
                             "in 9000 tokens. Please reduce the length of the messages.")


def test_a_refusal_is_one_line_and_one_record_once(capsys: pytest.CaptureFixture[str]) -> None:
    log = RequestLog()
    error = ApiError(400, "'messages[1]' must be an object", param="messages[1]")
    assert refused(log, _http(), "anthropic", error) is error
    refused(log, _http(), "anthropic", error)  # the same refusal again: already said
    [line] = capsys.readouterr().err.splitlines()
    assert line == "refused POST /v1/messages (anthropic): 400 'messages[1]': 'messages[1]' must be an object"
    records, totals = log.figures()
    [record] = records
    assert {k: record[k] for k in ("id", "door", "status", "param", "path", "method", "error")} == {
        "id": None, "door": "anthropic", "status": "400", "param": "messages[1]", "path": "/v1/messages",
        "method": "POST", "error": "'messages[1]' must be an object"}
    assert (totals["requests"], totals["refused"]) == (0, 1)  # refused requests are counted apart


def test_a_refusal_goes_to_the_request_log_file(tmp_path: Any) -> None:
    log = RequestLog(path=tmp_path / "requests.jsonl")
    refused(log, _http("GET", "/v1/models"), "openai", ApiError(401, "invalid or missing API key"))
    assert '"status": "401"' in log.path.read_text() and '"door": "openai"' in log.path.read_text()


def test_a_draining_server_admits_nothing_and_says_when_to_come_back() -> None:
    queue: Any = types.SimpleNamespace(drain_ends=time.monotonic() + 12.5, in_flight=0, capacity=8)
    with pytest.raises(ApiError) as e:
        admit(queue)
    assert e.value.status == 503 and e.value.headers["Retry-After"] in ("12", "13")  # the drain's time left
    assert "shutting down (SIGTERM)" in e.value.message
    queue.drain_ends = None  # not draining: the room for one more is all that counts
    admit(queue)
    queue.in_flight = 8
    with pytest.raises(ApiError) as e:
        admit(queue)
    assert e.value.status == 429
