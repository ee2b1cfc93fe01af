"""hub/cache.py: huggingface_hub's own cache layout, and its offline switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.hub.cache import hub_cache_dir, offline, repo_folder


def test_a_repos_folder_is_huggingface_hubs_own_name() -> None:
    assert repo_folder("mlx-community/Qwen3-0.6B-4bit") == "models--mlx-community--Qwen3-0.6B-4bit"


def test_the_cache_is_under_the_given_hf_home_else_this_machines(tmp_path: Path) -> None:
    assert hub_cache_dir(str(tmp_path)) == tmp_path / "hub"
    assert hub_cache_dir("~/hf") == Path.home() / "hf" / "hub"
    from huggingface_hub import constants

    assert hub_cache_dir(None) == Path(constants.HF_HUB_CACHE)


def test_offline_is_what_huggingface_hub_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert offline() is True
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert offline() is False
