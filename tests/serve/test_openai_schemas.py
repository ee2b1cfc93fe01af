"""serve/openai_schemas.py: OpenAI Chat's ``image_url`` parts, each bad one a 400 naming its message and part."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import pytest

from fixtures.vision_models import VisionModels
from fixtures.vision_models import test_image as picture_bytes
from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.openai_schemas import parse
from mlxpipe.vision.images import ImageLimits

_IDS = itertools.count()


def _body(*uris: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": uri}} for uri in uris]
    return {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}]}


def _uri(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(picture_bytes(seed)).decode()


@pytest.fixture(scope="module")
def settings(vision_models: VisionModels) -> ServerSettings:
    from mlxpipe.vision.prompt import VisionPrompt

    path = vision_models["qwen2_5_vl"]
    config = json.loads((path / "config.json").read_text())
    return ServerSettings(model_id="m", api_key=None, context=4096, vision=VisionPrompt(path, config),
                          image_limits=ImageLimits(max_images=2))


def test_images_become_the_processors_tokens(settings: ServerSettings) -> None:
    parsed = parse(_body(_uri(0)), True, settings, None, lambda: str(next(_IDS)))  # type: ignore[arg-type]
    request = parsed.request
    assert len(request.images) == 1 and request.vision_prompt is not None
    assert "<|image_pad|>" in request.vision_prompt and "What is it?" in request.vision_prompt
    assert request.tokens and request.messages is None


def test_text_only_model_refuses_an_image() -> None:
    text_only = ServerSettings(model_id="m", api_key=None, context=4096)
    with pytest.raises(ApiError) as info:
        parse(_body(_uri(0)), True, text_only, None, lambda: "x")  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, "messages[1].content[0]")
    assert "takes no images" in info.value.message


@pytest.mark.parametrize(("uris", "param", "words"), [
    (("data:image/png;base64,aGVsbG8=",), "messages[1].content[0]", "not an image that can be decoded"),
    (("nope",), "messages[1].content[0]", "must be a data: URI"),
    ((_uri(0), _uri(1), _uri(2)), "messages[1].content[2]", "at most 2 images"),
])
def test_bad_images_are_400s_naming_the_part(settings: ServerSettings, uris: tuple[str, ...], param: str,
                                             words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(_body(*uris), True, settings, None, lambda: "x")  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, param)
    assert words in info.value.message


def test_an_earlier_calls_arguments_must_be_json() -> None:
    """An assistant's earlier call reaches the template with its arguments as an object (as mlx_lm.server and
    mlx-vlm's server give it); arguments that are not JSON are a 400 naming them."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                                                             "tool_calls": [call]}]}
    with pytest.raises(ApiError) as info:
        parse(body, True, ServerSettings(model_id="m", api_key=None, context=4096), None,  # type: ignore[arg-type]
              lambda: "x")
    assert (info.value.status, info.value.param) == (400, "messages[1].tool_calls[0].function.arguments")
