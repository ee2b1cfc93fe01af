"""cluster/presets.py: configs/*.yaml, read and checked, naming the file and key at fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.cluster.presets import Preset, load_preset, pick
from mlxpipe.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    return path


def test_every_shipped_preset_loads() -> None:
    shipped = sorted((REPO / "configs").glob("*.yaml"))
    assert shipped
    for path in shipped:
        assert isinstance(load_preset(path), Preset)


def test_generation_defaults_may_be_grouped_and_a_split_becomes_a_tuple(tmp_path: Path) -> None:
    preset = load_preset(write(tmp_path, "model: org/m\nsplit: [12, 18]\ntp: 2\ngenerate:\n  temp: 1\n  seed: 3\n"))
    assert preset == Preset(model="org/m", split=(12, 18), tp=2, temp=1.0, seed=3)
    assert type(preset.temp) is float  # checked as the request checks it
    assert load_preset(None) == Preset() == load_preset(write(tmp_path, ""))


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]\n", "expected a mapping of keys to values"),
    ("modle: org/m\n", "unknown key 'modle'"),
    ("max_tokens: many\n", "key 'max_tokens' must be int, got 'many'"),
    ("seed: true\n", "key 'seed' must be int, got True"),
    ("split: [1, two]\n", "key 'split' must be a list of layer counts"),
    ("generate: 3\n", "'generate' must be a mapping"),
    ("top_p: 1.5\n", "key 'top_p' must be in (0, 1], got 1.5"),
    ("model: [unclosed\n", "cannot read config"),
])
def test_a_bad_preset_names_its_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_preset(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_preset_points_to_the_examples(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_preset(tmp_path / "nope.yaml")
    assert info.value.message == f"{tmp_path / 'nope.yaml'}: no such config"
    assert info.value.hint == "see configs/ for examples"


def test_a_flag_wins_over_the_preset_which_wins_over_the_default() -> None:
    assert pick(3, 2, 1) == 3
    assert pick(None, 2, 1) == 2
    assert pick(None, None, 1) == 1
    assert pick(0, 2) == 0  # a flag set to a falsy value is still set
