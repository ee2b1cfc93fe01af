"""paths.py: mlxpipe's home, and files replaced whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.paths import mlxpipe_home, replacing, write_atomic


def test_the_home_is_mlxpipe_home_else_under_the_users_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path / "mine"))
    assert mlxpipe_home() == tmp_path / "mine"
    monkeypatch.delenv("MLXPIPE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert mlxpipe_home() == tmp_path / ".cache" / "mlxpipe"


def test_a_file_is_replaced_whole(tmp_path: Path) -> None:
    tmp_path = tmp_path / "out"  # tmp_path itself holds the test's HOME
    tmp_path.mkdir()
    path = tmp_path / "results.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary file left


def test_an_error_part_way_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    path = tmp_path / "adapters.safetensors"
    path.write_text("old")
    with pytest.raises(RuntimeError), replacing(path, suffix=".safetensors") as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".safetensors") and tmp.name.startswith(".")
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters.safetensors"]
