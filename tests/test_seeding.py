"""The suite's seeding by default (``fixtures/seeding.py``): MLX's random state, and sampled requests' seeds."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from fixtures.seeding import MLX_SEED, SEED, with_seed


class _Echo(BaseHTTPRequestHandler):
    """Answers every POST with the body it received (what the server would have read)."""

    def do_POST(self) -> None:  # http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[str]:
    """The base URL of a local HTTP server that echoes request bodies."""
    server = HTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions", {"messages": [], "temperature": 0.8}, {"messages": [], "temperature": 0.8, "seed": SEED}),
    ("/v1/completions", {"prompt": "x"}, {"prompt": "x", "seed": SEED}),  # the door's default may sample
    ("/v1/messages", {"max_tokens": 5, "temperature": 1}, {"max_tokens": 5, "temperature": 1, "seed": SEED}),
    ("/v1/responses", {"input": "x", "temperature": 0.8}, {"input": "x", "temperature": 0.8, "seed": SEED}),
    ("/api/chat", {"messages": []}, {"messages": [], "options": {"seed": SEED}}),
    ("/api/generate", {"options": {"temperature": 0.5}}, {"options": {"temperature": 0.5, "seed": SEED}}),
])
def test_a_sampled_body_without_a_seed_gets_one_where_its_door_reads_it(path: str, body: dict[str, Any],
                                                                        expected: dict[str, Any]) -> None:
    assert with_seed(path, body) == expected


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"temperature": 0}),  # greedy
    ("/v1/chat/completions", {"temperature": 1.0, "seed": 3}),  # its own seed
    ("/v1/chat/completions", {"temperature": "hot"}),  # a bad value under test stays bad
    ("/v1/chat/completions", [1, 2]),  # not an object
    ("/api/chat", {"options": {"temperature": 0}}),
    ("/api/chat", {"options": "fast"}),
    ("/api/chat", {"options": {"seed": 9}}),
    ("/v1/messages/count_tokens", {"messages": []}),  # not a generation
    ("/health", {}),
])
def test_any_other_body_goes_unchanged(path: str, body: Any) -> None:
    assert with_seed(path, body) is body


def test_a_request_to_a_local_server_carries_the_seed_through_httpx(echo: str) -> None:
    received = httpx.post(f"{echo}/v1/chat/completions", json={"messages": [], "temperature": 0.7}).json()
    assert received == {"messages": [], "temperature": 0.7, "seed": SEED}
    greedy = {"messages": [], "temperature": 0}
    assert httpx.post(f"{echo}/v1/chat/completions", json=greedy).json() == greedy


def test_requests_through_the_openai_anthropic_and_ollama_packages_carry_the_seed(echo: str) -> None:
    gpt = openai.OpenAI(base_url=f"{echo}/v1", api_key="unused", max_retries=0)
    raw = gpt.chat.completions.with_raw_response.create(model="m", temperature=0.9,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert json.loads(raw.http_response.content)["seed"] == SEED
    claude = anthropic.Anthropic(base_url=echo, api_key="unused", max_retries=0)
    raw = claude.messages.with_raw_response.create(model="m", max_tokens=5,
                                                   messages=[{"role": "user", "content": "hi"}])
    assert json.loads(raw.http_response.content)["seed"] == SEED
    llama = ollama.Client(host=echo)
    sent = llama._client.post("/api/chat", json={"model": "m", "messages": [], "stream": False}).json()
    assert sent["options"] == {"seed": SEED}


def test_each_test_starts_from_the_same_mlx_random_state() -> None:
    import mlx.core as mx

    drawn = mx.random.uniform(shape=(4,))
    mx.random.seed(MLX_SEED)
    assert mx.array_equal(drawn, mx.random.uniform(shape=(4,)))


def test_each_test_starts_from_the_same_python_random_state() -> None:
    import random

    drawn = [random.random() for _ in range(4)]
    random.seed(MLX_SEED)
    assert drawn == [random.random() for _ in range(4)]
