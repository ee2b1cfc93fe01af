"""serve/app.py: the HTTP app over a scripted queue, in-process: the doors' routes behind the key, unknown routes.

(``/health`` asks the queue for more than the scripted queue has; a real server answers it in
``tests/e2e/test_serve_openai.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.serve_process import KEY
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog


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
