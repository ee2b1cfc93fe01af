"""Hub metadata through the real huggingface_hub client, against the fake hub."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.fake_hub import FAKE_TOKEN, FakeHub
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.cli import app
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.errors import HubError, ModelError
from mlxpipe.hub.client import load_metadata
from mlxpipe.model.metadata import load_local
from mlxpipe.plan.shard import make_plan

REPO = Path(__file__).resolve().parents[2]
LOCAL_2 = REPO / "hostfiles" / "local-2.json"
MLXPIPE = Path(sys.executable).parent / "mlxpipe"
LOGIN = "log in with `hf auth login` or set HF_TOKEN"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("hub") / "llama")


@pytest.fixture
def repo(hub_env: FakeHub, model: Path, request: pytest.FixtureRequest) -> str:
    """The tiny checkpoint as a repo whose id is unique to this test."""
    repo_id = "test-plan/" + re.sub(r"[^\w.-]+", "-", request.node.name).strip("-")
    hub_env.add_repo(repo_id, model)
    return repo_id


def plan_json(plan: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(plan.to_json()))
    del data["model"], data["commit"]
    return data


def test_hub_metadata_equals_the_local_read(hub_env: FakeHub, repo: str, model: Path) -> None:
    hub, local = load_metadata(repo), load_local(model)
    assert set(hub.tensors) == set(local.tensors)
    assert len(hub.tensors) == len(local.tensors)
    assert (hub.config, hub.file_sizes, hub.support_files) == (local.config, local.file_sizes, local.support_files)
    assert (hub.source, hub.revision, hub.commit, hub.local) == (repo, "main", hub_env.commit_sha(repo), False)
    hosts = load_hostfile(LOCAL_2).hosts
    assert plan_json(make_plan(hub, hosts)) == plan_json(make_plan(local, hosts))


def test_plan_of_a_hub_repo_through_the_cli(hub_env: FakeHub, repo: str, model: Path) -> None:
    result = CliRunner().invoke(app, ["plan", "--model", repo, "--hostfile", str(LOCAL_2), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["model"], data["commit"]) == (repo, hub_env.commit_sha(repo))
    expected = make_plan(load_local(model), load_hostfile(LOCAL_2).hosts)
    del data["model"], data["commit"]
    assert data == plan_json(expected)


def test_header_reads_are_range_requests_only(hub_env: FakeHub, repo: str, model: Path) -> None:
    load_metadata(repo)
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    gets = [r for r in hub_env.requests if r.method == "GET" and r.filename is not None]
    # Whole files: only the small JSON ones. The shards: one ranged read each, of the header only.
    assert sorted(r.filename for r in gets if r.range is None) == ["config.json", "model.safetensors.index.json"]
    shard_gets = [r for r in gets if r.filename.endswith(".safetensors")]
    assert sorted(r.filename for r in shard_gets) == shards
    for r in shard_gets:
        assert (r.range, r.status) == ("bytes=0-100000", 206)
        assert r.bytes_sent < hub_env.file(repo, r.filename).size
    assert hub_env.bytes_served(repo) < sum((model / s).stat().st_size for s in shards) // 2


def test_a_second_load_makes_no_request(hub_env: FakeHub, repo: str) -> None:
    first = load_metadata(repo)
    assert hub_env.requests != []
    hub_env.reset_log()
    assert load_metadata(repo) == first
    assert load_metadata(repo, revision=first.commit) == first
    assert hub_env.requests == []


def test_a_second_plan_subprocess_makes_no_request(hub_env: FakeHub, repo: str) -> None:
    args = [str(MLXPIPE), "plan", "--model", repo, "--hostfile", str(LOCAL_2), "--json"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert (first.returncode, first.stderr) == (0, "")
    hub_env.reset_log()
    second = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert (second.returncode, second.stderr, second.stdout) == (0, "", first.stdout)
    assert hub_env.requests == []


def test_refresh_reads_the_new_commit(hub_env: FakeHub, repo: str, model: Path) -> None:
    old = load_metadata(repo)
    config = {**json.loads((model / "config.json").read_text()), "max_position_embeddings": 1234}
    new_commit = hub_env.add_file(repo, "config.json", json.dumps(config).encode())
    assert load_metadata(repo).commit == old.commit  # cached by revision until refreshed
    fresh = load_metadata(repo, refresh=True)
    assert (fresh.commit, fresh.config["max_position_embeddings"]) == (new_commit, 1234)
    hub_env.reset_log()
    assert load_metadata(repo).commit == new_commit
    assert hub_env.requests == []


def test_missing_repo(hub_env: FakeHub) -> None:
    with pytest.raises(HubError) as e:
        load_metadata("nobody/no-such-model")
    assert str(e.value) == f"nobody/no-such-model: no such model repo on {hub_env.endpoint}, or it is private"
    assert e.value.hint == f"check the name; if it is private, {LOGIN}"


def test_private_repo_looks_missing(hub_env: FakeHub, model: Path) -> None:
    hub_env.add_repo("test-plan/private", model, private=True)
    with pytest.raises(HubError) as e:
        load_metadata("test-plan/private")
    assert str(e.value) == f"test-plan/private: no such model repo on {hub_env.endpoint}, or it is private"


def test_gated_repo_says_how_to_log_in(hub_env: FakeHub, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_env.add_repo("test-plan/gated", model, gated=True)
    with pytest.raises(HubError) as e:
        load_metadata("test-plan/gated")
    assert str(e.value) == "test-plan/gated is gated: you must accept its terms and be logged in"
    assert e.value.hint == f"accept the terms on the model's page, then {LOGIN}"
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    assert load_metadata("test-plan/gated").commit == hub_env.commit_sha("test-plan/gated")


def test_unknown_revision(hub_env: FakeHub, repo: str) -> None:
    with pytest.raises(HubError) as e:
        load_metadata(repo, revision="no-such-branch")
    assert (str(e.value), e.value.hint) == (f"{repo}: no such revision", "check --revision")


@pytest.mark.parametrize(
    ("model_id", "stderr"),
    [
        ("nobody/no-such-model", "error: nobody/no-such-model: no such model repo on {endpoint}, or it is private\n"
                                 "hint: check the name; if it is private, " + LOGIN + "\n"),
        ("test-plan/gated-cli", "error: test-plan/gated-cli is gated: you must accept its terms and be logged in\n"
                                "hint: accept the terms on the model's page, then " + LOGIN + "\n"),
    ],
)
def test_hub_errors_through_the_cli(hub_env: FakeHub, model: Path, model_id: str, stderr: str) -> None:
    hub_env.add_repo("test-plan/gated-cli", model, gated=True)
    result = CliRunner().invoke(app, ["plan", "--model", model_id, "--hostfile", str(LOCAL_2)])
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", stderr.format(endpoint=hub_env.endpoint))


def test_index_naming_a_file_outside_the_repo_fetches_no_shard(hub_env: FakeHub, model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    hub_env.add_repo("test-plan/escaping", bad)
    with pytest.raises(ModelError) as e:
        load_metadata("test-plan/escaping")
    assert str(e.value) == (
        "test-plan/escaping: the weight index names the file '../../etc/passwd', which escapes the model directory"
    )
    assert [r.filename for r in hub_env.requests if r.filename and r.filename.endswith(".safetensors")] == []
