"""cluster/target.py: what a command works on, resolved once: flag, then preset, then default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxpipe.cluster.target import DEFAULT_HOSTFILE, default_hostfile, default_model, resolve_target
from mlxpipe.errors import ModelError, UsageError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def four_hosts(tmp_path: Path) -> Path:
    path = tmp_path / "four.json"
    path.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 4))
    return path


@pytest.fixture
def preset(tmp_path: Path) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text("model: org/preset-model\nrevision: v2\nsplit: [1, 3]\ntp: 2\n")
    return path


def test_flags_win_over_the_preset(four_hosts: Path, preset: Path) -> None:
    target = resolve_target("org/flag-model", None, four_hosts, "even", None, preset, 1)
    assert (target.model, target.strategy, target.split, target.tp) == ("org/flag-model", "even", None, 1)
    # A preset's revision belongs to the preset's model: --model drops it.
    assert target.revision is None
    assert target.hostfile.size == 4


def test_the_preset_fills_what_no_flag_gives(four_hosts: Path, preset: Path) -> None:
    target = resolve_target(None, None, four_hosts, None, None, preset)
    assert (target.model, target.revision, target.split, target.tp) == ("org/preset-model", "v2", (1, 3), 2)


def test_a_bad_tp_from_the_preset_names_the_preset(tmp_path: Path, preset: Path) -> None:
    three = tmp_path / "three.json"
    three.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3))
    with pytest.raises(UsageError, match=rf"^{preset}: key 'tp'"):
        resolve_target(None, None, three, None, None, preset)
    with pytest.raises(UsageError, match=r"^--tp"):
        resolve_target("org/m", None, three, None, None, None, 2)


def test_without_a_hostfile_two_local_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)
    assert default_hostfile().size == 2 and DEFAULT_HOSTFILE.exists()
    monkeypatch.chdir(tmp_path)  # away from the repository: the same two ranks, built in
    built_in = default_hostfile()
    assert built_in.size == 2 and all(h.is_local for h in built_in.hosts)


def test_without_a_model_the_demo_model_must_have_been_built() -> None:
    # isolated_home: a fresh MLXPIPE_HOME, where no demo model was built.
    with pytest.raises(ModelError) as info:
        default_model()
    assert "the demo model is not built yet" in info.value.message
    assert info.value.hint == "build it with `mlxpipe demo-model` (or `make demo`), or pass --model"
