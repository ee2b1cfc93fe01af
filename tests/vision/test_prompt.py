"""The vision extra stays optional: a text-only install says what to install, and never imports mlx-vlm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxpipe.cli.generate import read_images
from mlxpipe.errors import UsageError
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
