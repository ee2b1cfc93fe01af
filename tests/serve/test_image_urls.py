"""serve/image_urls.py: with --allow-image-urls, the image URLs of OpenAI Chat, Responses and Anthropic bodies are
fetched from a real HTTP server on 127.0.0.1 and reach the model as the image itself; each URL that gives no image
(an error status, not an image, too big, too slow) is a 400 naming its message and part; without the flag, a URL
is a 400 naming the flag. In-process: the app over a scripted queue, no ranks."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.vision_models import VisionModels
from fixtures.vision_models import test_image as picture_bytes
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog
from mlxpipe.vision.images import ImageLimits

PICTURE = picture_bytes(3)
MAX_BYTES = len(PICTURE) + 100  # the picture fits; /big does not
SLOW_SECONDS, TIMEOUT = 10.0, 0.5  # the slow picture comes far too late for the timeout, whatever the load


class _Images(BaseHTTPRequestHandler):
    """The image server: a picture, and each way a URL can fail to give one; ``asked``: every path asked for."""

    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        if self.path == "/slow.png":
            time.sleep(SLOW_SECONDS)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body, kind = {
            "/picture.png": (PICTURE, "image/png"), "/slow.png": (PICTURE, "image/png"),
            "/octets": (PICTURE, "application/octet-stream"), "/page.html": (b"<html></html>", "text/html"),
            "/fake.png": (b"not a picture at all", "image/png"), "/big.png": (b"\0" * (MAX_BYTES + 1), "image/png"),
        }[self.path]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        if self.path != "/big.png":  # the big one streams without a length: the cap counts the bytes read
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet: pytest shows stderr of failures only
        pass


@pytest.fixture(scope="module")
def images_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _app(vision_models: VisionModels, timeout: float | None) -> tuple[TestClient, ScriptedQueue]:
    from mlxpipe.vision.prompt import VisionPrompt

    path = vision_models["qwen2_5_vl"]
    config = json.loads((path / "config.json").read_text())
    settings = ServerSettings(model_id="m", api_key=None, context=4096, vision=VisionPrompt(path, config),
                              image_limits=ImageLimits(max_bytes=MAX_BYTES, max_images=2),
                              image_url_timeout=timeout)
    tokenizer = load_tokenizer(path)
    queue = ScriptedQueue(tokenizer, "A picture.")
    return TestClient(build_app(queue, tokenizer, settings, RequestLog())), queue  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fetching(vision_models: VisionModels) -> Iterator[tuple[TestClient, ScriptedQueue]]:
    client, queue = _app(vision_models, TIMEOUT)
    with client:
        yield client, queue


@pytest.fixture(scope="module")
def refusing(vision_models: VisionModels) -> Iterator[TestClient]:
    client, _ = _app(vision_models, None)
    with client:
        yield client


# Each door's body with its image URLs, and the name its errors give the first one's part.
def _openai(*urls: str) -> tuple[str, dict[str, Any], str]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ("/v1/chat/completions", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]}, "messages[0].content[0]")


def _responses(*urls: str) -> tuple[str, dict[str, Any], str]:
    parts: list[dict[str, Any]] = [{"type": "input_image", "image_url": u} for u in urls]
    return ("/v1/responses", {"max_output_tokens": 4, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, *parts]}]},
        "input[0].content[1].image_url")


def _anthropic(*urls: str) -> tuple[str, dict[str, Any], str]:
    parts: list[dict[str, Any]] = [{"type": "image", "source": {"type": "url", "url": u}} for u in urls]
    return ("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]},
        "messages[0].content[0].source.url")


DOORS = [_openai, _responses, _anthropic]


def _error(response: Any) -> tuple[str, str | None]:
    """The message and the part named, in OpenAI's shape or Anthropic's."""
    error = response.json()["error"]
    return error["message"], error.get("param")


@pytest.mark.parametrize("door", DOORS)
def test_an_image_url_reaches_the_model_as_its_image(fetching: tuple[TestClient, ScriptedQueue], images_url: str,
                                                     door: Any) -> None:
    client, queue = fetching
    path, body, _ = door(f"{images_url}/picture.png", f"{images_url}/octets")
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    sent = queue.requests[-1]
    assert [image.sha256 for image in sent.images] == [hashlib.sha256(PICTURE).hexdigest()] * 2


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("name", "words"), [
    ("missing.png", "could not be fetched: the server answered 404"),
    ("page.html", "could not be fetched: it is text/html, not an image"),
    ("big.png", f"could not be fetched: it is over the limit of {MAX_BYTES} bytes (--max-image-mb)"),
    ("slow.png", f"could not be fetched: no whole answer within {TIMEOUT:g} s (--image-url-timeout)"),
    ("fake.png", "not an image that can be decoded"),
])
def test_an_image_url_that_gives_no_image_is_a_400_naming_the_part(fetching: tuple[TestClient, ScriptedQueue],
                                                                    images_url: str, door: Any, name: str,
                                                                    words: str) -> None:
    client, queue = fetching
    asked = len(queue.requests)
    path, body, where = door(f"{images_url}/{name}")
    response = client.post(path, json=body)
    # For slow.png the words below are the timeout's: a fetch that waited for its picture would give a 200.
    assert response.status_code == 400, response.text
    message, param = _error(response)
    assert words in message, message
    if "fetched" in words:
        assert message.startswith(f"'{where}': the image at {images_url}/{name}"), message
    else:  # fetched, then checked as an inline image: the part is named as the door names an inline one
        assert where.split(".source")[0].removesuffix(".image_url") in message, message
    if door is not _anthropic:
        assert param is not None and param.startswith(where.removesuffix(".image_url"))
    assert len(queue.requests) == asked  # nothing reached the queue


def test_more_urls_than_the_image_limit_are_refused_before_any_fetch(fetching: tuple[TestClient, ScriptedQueue],
                                                                    images_url: str) -> None:
    client, _ = fetching
    path, body, _ = _openai(*(f"{images_url}/slow.png",) * 3)
    asked = len(_Images.asked)
    response = client.post(path, json=body)
    assert response.status_code == 400 and _error(response) == (
        "'messages[0].content[2]': a request may hold at most 2 images", "messages[0].content[2]")
    assert _Images.asked[asked:] == []  # not one of them was fetched


@pytest.mark.parametrize(("door", "words"), [
    (_openai, "image URLs are not fetched by this server without --allow-image-urls"),
    (_responses, "image URLs are not fetched by this server without --allow-image-urls"),
    (_anthropic, "url sources are fetched only by a server started with --allow-image-urls"),
])
def test_without_the_flag_a_url_is_a_400_naming_the_flag(refusing: TestClient, images_url: str, door: Any,
                                                         words: str) -> None:
    path, body, _ = door(f"{images_url}/picture.png")
    response = refusing.post(path, json=body)
    assert response.status_code == 400, response.text
    assert words in _error(response)[0]
