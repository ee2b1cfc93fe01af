"""The vision extra stays optional: a text-only install says what to install, and never imports mlx-vlm."""

from __future__ import annotations

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
    from mlxpipe.worker.vision import image_token_of

    config = json.loads((vision_models[family] / "config.json").read_text())
    vision = prompt.VisionPrompt(vision_models[family], config)
    image = check_image(picture_bytes(0))
    request = vision.tokenize(Request(prompt="Describe this.", images=(image,)))
    assert request.tokens is not None and request.vision_prompt is not None
    inputs = prompt.process(vision.processor, config, request.vision_prompt, (image,))
    placeholders = request.tokens.count(image_token_of(config) or -1)
    assert placeholders == MERGED_PATCHES[family](inputs, config) > 1
