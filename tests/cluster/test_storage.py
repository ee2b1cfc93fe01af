"""cluster/storage.py: where each host keeps the model's files (its Hugging Face cache, or a plain directory), and the
prompt cache's disk tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.cluster.hostfile import parse_hostfile
from mlxpipe.cluster.storage import REMOTE_HF_HOME, hf_home, local_dir, model_path, prompt_cache_dir
from mlxpipe.host import Host
from mlxpipe.model.metadata import ModelMetadata

HUB_MODEL = ModelMetadata("org/model", {}, (), {}, commit="c0ffee")
LOCAL_MODEL = ModelMetadata("/models/tiny-llama", {}, (), {}, local=True)


def host(**keys: str) -> Host:
    return parse_hostfile([{"ips": ["10.0.0.2"], **keys}], Path("h.json")).hosts[0]


def test_a_hub_model_goes_to_the_hosts_hugging_face_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    here = host(ssh="127.0.0.1")
    assert model_path(here, HUB_MODEL) == f"{tmp_path}/hf/hub/models--org--model/snapshots/c0ffee"
    # A remote host's own default, expanded there.
    assert model_path(host(ssh="studio-2"), HUB_MODEL) == f"{REMOTE_HF_HOME}/hub/models--org--model/snapshots/c0ffee"
    # The hostfile's hf_home wins.
    assert hf_home(host(ssh="studio-2", hf_home="/Volumes/fast/hf")) == "/Volumes/fast/hf"
    assert model_path(host(ssh="studio-2", hf_home="/Volumes/fast/hf/"), HUB_MODEL).startswith("/Volumes/fast/hf/hub/")


def test_a_host_with_a_model_dir_keeps_plain_directories() -> None:
    studio = host(ssh="studio-2", model_dir="/Volumes/models/")
    assert local_dir(studio, HUB_MODEL) == "/Volumes/models/org/model"
    assert model_path(studio, LOCAL_MODEL) == "/Volumes/models/tiny-llama"


def test_a_local_model_stays_where_it_is_here_and_goes_under_mlxpipes_home_elsewhere() -> None:
    assert model_path(host(ssh="127.0.0.1"), LOCAL_MODEL) == "/models/tiny-llama"
    assert model_path(host(ssh="studio-2"), LOCAL_MODEL) == "~/.cache/mlxpipe/models/tiny-llama"
    assert local_dir(host(ssh="studio-2"), HUB_MODEL) is None  # the cache, not a plain directory


def test_the_prompt_cache_on_disk_goes_beside_the_models_or_home(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path / "mlxpipe"))
    assert prompt_cache_dir(host(ssh="127.0.0.1")) == f"{tmp_path}/mlxpipe/prompt-cache"
    assert prompt_cache_dir(host(ssh="studio-2")) == "~/.cache/mlxpipe/prompt-cache"  # expanded on that host
    beside = "/Volumes/fast/hf/mlxpipe/prompt-cache"  # the hostfile's hf_home: the disk the models are on
    assert prompt_cache_dir(host(ssh="studio-2", hf_home="/Volumes/fast/hf/")) == beside
    assert prompt_cache_dir(host(ssh="127.0.0.1", hf_home="/data/hf")) == "/data/hf/mlxpipe/prompt-cache"
    # --prompt-cache-dir: that path on every host.
    assert prompt_cache_dir(host(ssh="studio-2", hf_home="/x"), "/fast/kv") == "/fast/kv"
