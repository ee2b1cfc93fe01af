"""vision/prompt.py: the vision extra stays optional (a text-only install says what to install, and never imports
mlx-vlm); a request with images, its tools, template variables and prefill become mlx-vlm's own prompt tokens."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fixtures.vision_models import VisionModels
from fixtures.vision_models import test_image as picture_bytes
from mlxpipe.cli.generate import read_images
from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Request
from mlxpipe.vision import prompt
from mlxpipe.vision.images import check_image as image_of


def test_text_only_install_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(prompt, "vision_installed", lambda: False)
    with pytest.raises(UsageError) as caught:
        read_images([tmp_path / "picture.png"])
    assert caught.value.message == "images need mlx-vlm, which this install lacks"
    assert caught.value.hint == "pip install 'mlxpipe[vision]'"
    assert read_images(None) == ()


def test_help_does_not_import_mlx_vlm() -> None:
    probe = (
        "import json, sys\n"
        "import mlxpipe\n"
        "from mlxpipe.cli import app\n"
        "try:\n    app(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx_vlm')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stderr) == []
    assert "--image" in proc.stdout


def test_vision_config() -> None:
    assert prompt.is_vision_config({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}})
    assert not prompt.is_vision_config({"model_type": "llama"})


# --- tools, template variables and a prefill with images, as single-process mlx-vlm renders them --------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "city": {"type": "string"}},
                   "required": ["city"]}}}]
ASKED = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is this?"}]}]
CALLED = [*ASKED, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 c"}]


@pytest.fixture(scope="module")
def qwen(vision_models: VisionModels) -> Path:
    return vision_models["qwen2_5_vl"]


def _reference(path: Path, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> tuple[str, list[int]]:
    """mlx-vlm's own: its processor (``mlx_vlm.load``), ``get_chat_template`` and ``prepare_inputs``."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import get_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens
    from PIL import Image as Pil

    model, processor = load(str(path))
    text = get_chat_template(processor, messages, add_generation_prompt, **kwargs)
    inputs = prepare_inputs(processor, images=[Pil.open(io.BytesIO(picture_bytes(0)))], prompts=text,
                            image_token_index=getattr(model.config, "image_token_index", None),
                            add_special_tokens=should_add_special_tokens(model.config.model_type, processor))
    return text, inputs["input_ids"].reshape(-1).tolist()


@pytest.mark.parametrize(("messages", "config", "expected", "shown"), [
    (ASKED, None, {}, "Where is this?"),
    (ASKED, None, {"tools": TOOLS}, "<tools>"),
    (CALLED, None, {"tools": TOOLS}, "<tool_response>\nsunny, 21 c\n</tool_response>"),
    (ASKED, {"enable_thinking": True, "tool_choice": "required"},
     {"tools": TOOLS, "enable_thinking": True, "tool_choice": "required"}, "<|im_start|>assistant\n<think>\n"),
], ids=["plain", "tools", "tool-results", "template-variables"])
def test_tools_and_switches_render_as_mlx_vlm(qwen: Path, messages: list[dict[str, Any]],
                                             config: dict[str, Any] | None, expected: dict[str, Any],
                                             shown: str) -> None:
    """A request with an image: its tools, its earlier calls and their results, and its template variables reach
    mlx-vlm's chat template as mlx-vlm's server gives them, and its tokens are mlx-vlm's."""
    vision = prompt.VisionPrompt(qwen, json.loads((qwen / "config.json").read_text()))
    request = Request(messages=messages, images=(image_of(picture_bytes(0)),), chat_template_config=config)
    made = vision.tokenize(request, expected.get("tools"))
    text, tokens = _reference(qwen, messages, **expected)
    assert made.vision_prompt == text and shown in text
    assert made.tokens == tokens


def test_a_prefill_is_continued(qwen: Path) -> None:
    """A last assistant turn (Anthropic's prefill) with an image: the prompt ends in its text, as the text path's
    (``continue_final_message``), and the tokens are mlx-vlm's of the same."""
    vision = prompt.VisionPrompt(qwen, json.loads((qwen / "config.json").read_text()))
    request = Request(messages=ASKED, images=(image_of(picture_bytes(0)),), prefill_response="It is")
    made = vision.tokenize(request, TOOLS)
    text, tokens = _reference(qwen, [*ASKED, {"role": "assistant", "content": "It is"}], False, tools=TOOLS,
                              continue_final_message=True)
    assert made.vision_prompt == text and text.endswith("<|im_start|>assistant\nIt is")
    assert made.tokens == tokens


# How many image features the vision tower hands the language model for one picture, from what the family's processor
# says of it (its grid of patches, merged 2 x 2, or Gemma 3's fixed count): a picture's placeholder tokens.
MERGED_PATCHES: dict[str, Callable[[dict[str, Any], dict[str, Any]], int]] = {
    "qwen2_5_vl": lambda inputs, config: math.prod(inputs["image_grid_thw"].tolist()[0]) // 4,
    "kimi_vl": lambda inputs, config: math.prod(inputs["image_grid_hws"].tolist()[0]) // 4,
    "gemma3": lambda inputs, config: int(config["text_config"]["mm_tokens_per_image"]),
    "mistral3": lambda inputs, config: math.prod(side // 14 // 2 for side in inputs["image_sizes"].tolist()[0]),
}


@pytest.mark.parametrize("family", list(MERGED_PATCHES))
def test_a_picture_is_one_placeholder_per_merged_patch(vision_models: VisionModels, family: str) -> None:
    """The tiny checkpoints' tokenizers name each family's own image token, so its processor expands a picture to
    as many placeholders as the vision tower gives features (a Qwen-VL picture: one per merged patch)."""
    from mlxpipe.vision.images import check_image
    from mlxpipe.worker.generation.vision_inputs import image_token_of

    config = json.loads((vision_models[family] / "config.json").read_text())
    vision = prompt.VisionPrompt(vision_models[family], config)
    image = check_image(picture_bytes(0))
    request = vision.tokenize(Request(prompt="Describe this.", images=(image,)))
    assert request.tokens is not None and request.vision_prompt is not None
    inputs = prompt.process(vision.processor, config, request.vision_prompt, (image,))
    placeholders = request.tokens.count(image_token_of(config) or -1)
    assert placeholders == MERGED_PATCHES[family](inputs, config) > 1
