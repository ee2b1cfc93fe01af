"""serve/router.py: one endpoint over several pipelines, in-process over scripted queues: each name reaches its
entry's pipeline through every door, an unknown name is a 404 in each door's shape listing the names, the lists
name every entry, --any-model-name sends unknown names to the first entry, replicas share the load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.serve_process import KEY
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog
from mlxpipe.serve.router import Router, Served

HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
DOORS = [
    ("/v1/chat/completions", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi?"}]}),
    ("/v1/completions", {"max_tokens": 8, "prompt": "Hi?"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi?"}]}),
    ("/v1/responses", {"input": "Hi?"}),
    ("/api/chat", {"messages": [{"role": "user", "content": "Hi?"}], "stream": False}),
    ("/api/generate", {"prompt": "Hi?", "stream": False}),
]


def served(tokenizer: Any, label: str, model: str, names: tuple[str, ...], text: str,
           any_model_name: bool = False) -> Served:
    settings = ServerSettings(model_id=model, api_key=KEY, context=4096, served_names=names,
                              any_model_name=any_model_name)
    queue = ScriptedQueue(tokenizer, text)
    queue.label = label
    return Served(label, queue, tokenizer, settings, RequestLog())  # type: ignore[arg-type]


def client(router: Router) -> TestClient:
    first = router.first
    return TestClient(build_app(first.queue, first.tokenizer, first.settings, first.log, first=router.routes()))


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    return load_tokenizer(demo_model)


@pytest.fixture(scope="module")
def fleet(tokenizer: Any) -> Iterator[tuple[Router, TestClient]]:
    router = Router([[served(tokenizer, "big", "org/big", ("coder",), "Paris.")],
                     [served(tokenizer, "small", "org/small", ("haiku",), "Rome.")]])
    with client(router) as http:
        yield router, http


@pytest.mark.parametrize(("path", "body"), DOORS)
@pytest.mark.parametrize(("name", "reply"), [("coder", "Paris."), ("org/big", "Paris."), ("haiku", "Rome."),
                                             ("org/small", "Rome."), (None, "Paris.")])
def test_each_name_reaches_its_entry_through_every_door(fleet: tuple[Router, TestClient], path: str,
                                                        body: dict[str, Any], name: str | None, reply: str) -> None:
    _, http = fleet
    if name is not None:
        body = {**body, "model": name + (":latest" if path.startswith("/api/") else "")}
    response = http.post(path, json=body, headers=HEADERS)
    assert response.status_code == 200, response.text
    other = "Rome." if reply == "Paris." else "Paris."
    assert reply in response.text and other not in response.text


@pytest.mark.parametrize(("path", "body"), DOORS)
def test_an_unknown_name_is_a_404_in_the_doors_shape_listing_the_names(fleet: tuple[Router, TestClient], path: str,
                                                                       body: dict[str, Any]) -> None:
    _, http = fleet
    response = http.post(path, json={**body, "model": "gpt-4"}, headers=HEADERS)
    assert response.status_code == 404
    listed = "this server serves 'org/big', 'coder', 'org/small', 'haiku'"
    data = response.json()
    if path.startswith("/api/"):
        assert listed in data["error"]  # Ollama's shape: one message
    elif path == "/v1/messages":
        assert data["type"] == "error" and data["error"]["type"] == "not_found_error"
        assert listed in data["error"]["message"]
    else:
        assert data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model"
        assert listed in data["error"]["message"]


def test_the_lists_name_every_entry(fleet: tuple[Router, TestClient]) -> None:
    _, http = fleet
    names = ["org/big", "coder", "org/small", "haiku"]
    assert [m["id"] for m in http.get("/v1/models", headers=HEADERS).json()["data"]] == names
    assert [m["name"] for m in http.get("/api/tags", headers=HEADERS).json()["models"]] == names
    assert [m["name"] for m in http.get("/api/ps", headers=HEADERS).json()["models"]] == names
    assert http.get("/v1/models").status_code == 401  # behind the key, as a single model's list


def test_the_request_log_line_names_the_pipeline(fleet: tuple[Router, TestClient],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    router, http = fleet
    http.post("/v1/completions", json={"model": "haiku", "prompt": "Hi?", "max_tokens": 4}, headers=HEADERS)
    assert "(openai, small)" in capsys.readouterr().err
    assert router.entries[1][0].log.recent[-1]["pipeline"] == "small"


def test_any_model_name_sends_unknown_names_to_the_first_entry(tokenizer: Any) -> None:
    router = Router([[served(tokenizer, "big", "org/big", (), "Paris.", any_model_name=True)],
                     [served(tokenizer, "small", "org/small", (), "Rome.")]], any_model_name=True)
    with client(router) as http:
        unknown = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi?"}, headers=HEADERS)
        known = http.post("/v1/completions", json={"model": "org/small", "prompt": "Hi?"}, headers=HEADERS)
    assert unknown.status_code == 200 and "Paris." in unknown.text
    assert "Rome." in known.text


def test_a_request_goes_to_the_least_loaded_ready_replica(tokenizer: Any) -> None:
    replicas = [served(tokenizer, f"small#{i}", "org/small", (), "Rome.") for i in range(3)]
    router = Router([replicas])
    queues = [r.queue for r in replicas]
    queues[0].in_flight, queues[1].in_flight, queues[2].in_flight = 2, 1, 0  # type: ignore[misc]
    queues[2].state = "restarting"  # type: ignore[misc]
    assert router.pick("org/small") is replicas[1]
    queues[1].state = "failed"  # type: ignore[misc]
    assert router.pick("org/small") is replicas[0]
    assert router.pick("gpt-4") is None


def test_a_returning_conversation_goes_to_the_replica_that_was_sent_its_prefix(tokenizer: Any) -> None:
    replicas = [served(tokenizer, f"small#{i}", "org/small", (), "Rome.") for i in range(2)]
    router = Router([replicas])
    system = {"role": "system", "content": "Be terse."}
    a1 = {"messages": [system, {"role": "user", "content": "Name a city on a river, and the river."}]}
    b1 = {"messages": [system, {"role": "user", "content": "Name a river that crosses three countries."}]}
    # Two new conversations (their system prompt alike, a small share of each): spread over the replicas.
    assert [router.pick("org/small", a1), router.pick("org/small", b1)] == replicas
    b2 = {"messages": [*b1["messages"], {"role": "assistant", "content": "Rhine."}, {"role": "user", "content": "?"}]}
    a2 = {"messages": [*a1["messages"], {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "?"}]}
    # Each returns where it was: b2 first, where the replicas' load and counts alone would send it to small#0.
    assert [router.pick("org/small", b2), router.pick("org/small", a2)] == [replicas[1], replicas[0]]
    replicas[0].queue.in_flight = 3  # type: ignore[misc]
    assert router.pick("org/small", a2) is replicas[0]  # its prefix outweighs the load
    replicas[0].queue.state = "restarting"  # type: ignore[misc]
    assert router.pick("org/small", a2) is replicas[1]  # but not a replica that is not ready
