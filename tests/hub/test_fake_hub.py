"""The fake hub, exercised through the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from fixtures.fake_hub import FAKE_TOKEN, FakeHub, RequestRecord

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
# shard -> tensor -> (dtype, shape); shard 1 is a few MB so a dropped connection has room to resume.
TENSORS: dict[str, dict[str, tuple[str, list[int]]]] = {
    SHARDS[0]: {"model.embed_tokens.weight": ("F32", [1024, 768]), "model.layers.0.mlp.weight": ("BF16", [64, 64])},
    SHARDS[1]: {"model.layers.1.mlp.weight": ("F16", [256, 512])},
    SHARDS[2]: {"lm_head.weight": ("F32", [128, 512]), "model.norm.weight": ("F32", [512])},
}
ALL_FILES = sorted(["config.json", "tokenizer.json", INDEX, "extra/notes.txt", *SHARDS])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sharded checkpoint in the hub's layout, written with mlx."""
    import mlx.core as mx

    d = tmp_path_factory.mktemp("model")
    mx.random.seed(0)
    dtypes = {"F32": mx.float32, "BF16": mx.bfloat16, "F16": mx.float16}
    for shard, tensors in TENSORS.items():
        arrays = {name: mx.random.normal(shape).astype(dtypes[dt]) for name, (dt, shape) in tensors.items()}
        mx.save_safetensors(str(d / shard), arrays, metadata={"format": "mlx"})
    weight_map = {name: shard for shard, tensors in TENSORS.items() for name in tensors}
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("nested file\n")
    return d


@pytest.fixture
def repo(hub_env: FakeHub, model_dir: Path, request: pytest.FixtureRequest) -> str:
    """The checkpoint as a repo whose id is unique to this test."""
    repo_id = "test/" + re.sub(r"[^\w.-]+", "-", request.node.name).strip("-")
    hub_env.add_repo(repo_id, model_dir)
    return repo_id


def content_gets(hub: FakeHub) -> list[RequestRecord]:
    return [r for r in hub.requests if r.method == "GET" and r.filename is not None]


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def safetensors_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def test_hf_hub_download_caches_files_under_their_etags(hub_env: FakeHub, repo: str, model_dir: Path) -> None:
    commit = hub_env.commit_sha(repo)
    for name in ("config.json", "extra/notes.txt", SHARDS[1]):
        path = Path(hf_hub_download(repo, name))
        f = hub_env.file(repo, name)
        assert path.read_bytes() == (model_dir / name).read_bytes()
        assert path.resolve().name == f.etag  # blobs/<etag>
        assert f"snapshots/{commit}/" in path.as_posix()
    assert re.fullmatch(r"[0-9a-f]{40}", hub_env.file(repo, "config.json").etag)  # git blob sha1
    assert hub_env.file(repo, SHARDS[1]).etag == sha256(model_dir / SHARDS[1])  # LFS: sha256


def test_snapshot_download_fetches_exactly_the_allowed_files(hub_env: FakeHub, repo: str, model_dir: Path) -> None:
    wanted = {"config.json", "tokenizer.json", INDEX, SHARDS[1]}

    folder = Path(snapshot_download(repo, allow_patterns=["*.json", SHARDS[1]]))

    assert sorted(r.filename for r in content_gets(hub_env)) == sorted(wanted)
    assert hub_env.bytes_served(repo) == sum((model_dir / name).stat().st_size for name in wanted)
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == wanted
    assert (folder / SHARDS[1]).read_bytes() == (model_dir / SHARDS[1]).read_bytes()


def test_safetensors_metadata_comes_from_range_requests_only(hub_env: FakeHub, repo: str) -> None:
    meta = HfApi().get_safetensors_metadata(repo)

    for shard, tensors in TENSORS.items():
        got = meta.files_metadata[shard].tensors
        assert {name: (t.dtype, t.shape) for name, t in got.items()} == tensors
    shard_gets = [r for r in content_gets(hub_env) if r.filename in SHARDS]
    assert sorted(r.filename for r in shard_gets) == SHARDS
    for r in shard_gets:
        assert (r.range, r.status) == ("bytes=0-100000", 206)
        assert r.bytes_sent < hub_env.file(repo, r.filename).size


def test_a_header_over_100kb_is_read_with_a_second_range(hub_env: FakeHub, repo: str) -> None:
    header = {"__metadata__": {"pad": "x" * 150_000}, "w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}
    data = safetensors_bytes(header) + bytes(8)
    hub_env.add_file(repo, "wide.safetensors", data)

    meta = HfApi().parse_safetensors_file_metadata(repo, "wide.safetensors")

    assert meta.tensors["w"].shape == [4]
    assert [r.range for r in content_gets(hub_env)] == ["bytes=0-100000", f"bytes=8-{len(data) - 9}"]


def test_a_warm_cache_makes_no_content_request(hub_env: FakeHub, repo: str) -> None:
    hf_hub_download(repo, SHARDS[0])
    hub_env.reset_log()

    hf_hub_download(repo, SHARDS[0])  # a branch still costs one HEAD to resolve it
    assert [(r.method, r.filename) for r in hub_env.requests] == [("HEAD", SHARDS[0])]

    hub_env.reset_log()
    hf_hub_download(repo, SHARDS[0], revision=hub_env.commit_sha(repo))  # a commit sha costs nothing
    assert hub_env.requests == []


@pytest.mark.parametrize(
    ("repo_id", "filename", "revision", "error"),
    [
        ("nobody/missing", "config.json", "main", RepositoryNotFoundError),
        (None, "missing.json", "main", RemoteEntryNotFoundError),
        (None, "config.json", "no-such-branch", RevisionNotFoundError),
    ],
)
def test_the_client_raises_its_own_errors(
    hub_env: FakeHub, repo: str, repo_id: str | None, filename: str, revision: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as e:
        hf_hub_download(repo_id or repo, filename, revision=revision)
    assert not isinstance(e.value, GatedRepoError)
    if repo_id is not None or revision != "main":
        with pytest.raises(error):
            HfApi().model_info(repo_id or repo, revision=revision)


def test_a_gated_repo_needs_an_accepted_token(hub_env: FakeHub, model_dir: Path) -> None:
    hub_env.add_repo("test/gated", model_dir, gated=True)
    assert HfApi().model_info("test/gated").gated == "manual"  # the card is public, the files are not

    with pytest.raises(GatedRepoError) as anonymous:
        hf_hub_download("test/gated", "config.json")
    with pytest.raises(GatedRepoError) as refused:
        hf_hub_download("test/gated", "config.json", token="hf_not_granted")
    path = hf_hub_download("test/gated", "config.json", token=FAKE_TOKEN)

    assert (anonymous.value.response.status_code, refused.value.response.status_code) == (401, 403)
    assert Path(path).read_bytes() == (model_dir / "config.json").read_bytes()


def test_a_private_repo_looks_missing_without_a_token(hub_env: FakeHub, model_dir: Path) -> None:
    hub_env.add_repo("test/private", model_dir, private=True)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("test/private")
    assert HfApi().model_info("test/private", token=FAKE_TOKEN).private is True


def test_a_dropped_connection_is_resumed_with_a_range_request(hub_env: FakeHub, repo: str) -> None:
    f = hub_env.file(repo, SHARDS[0])
    hub_env.drop_connection(repo, SHARDS[0], after_bytes=1_000_000)

    path = hf_hub_download(repo, SHARDS[0])  # huggingface_hub retries inside the call, after 1 s

    assert sha256(path) == f.sha256
    first, second = content_gets(hub_env)
    assert (first.range, first.bytes_sent) == (None, 1_000_000)
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second.range or "").group(1))
    assert 0 < resumed_at <= 1_000_000  # whole 64 KiB chunks written before the drop
    assert (second.status, second.bytes_sent) == (206, f.size - resumed_at)


def test_a_corrupted_file_is_served_at_full_length_and_the_client_keeps_it(hub_env: FakeHub, repo: str) -> None:
    f = hub_env.file(repo, SHARDS[1])
    hub_env.corrupt(repo, SHARDS[1])

    bad = hf_hub_download(repo, SHARDS[1])  # huggingface_hub 2.4 checks the size, not the sha256
    assert Path(bad).stat().st_size == f.size
    assert sha256(bad) != f.sha256 == Path(bad).resolve().name

    good = hf_hub_download(repo, SHARDS[1], force_download=True)  # the fault fired once
    assert sha256(good) == f.sha256


def test_an_injected_503_is_retried_by_the_client(hub_env: FakeHub, repo: str) -> None:
    hub_env.fail(repo, "config.json", 503)
    hf_hub_download(repo, "config.json")
    assert [(r.method, r.status) for r in hub_env.requests] == [("HEAD", 503), ("HEAD", 200), ("GET", 200)]


def test_a_slow_file_stalls_before_its_body(hub_env: FakeHub, repo: str) -> None:
    hub_env.slow(repo, "config.json", 0.3)
    start = time.monotonic()
    hf_hub_download(repo, "config.json")
    assert time.monotonic() - start >= 0.3  # the stall happened: a lower bound that load only ever lengthens


def test_tree_pages_paths_info_and_model_info(hub_env: FakeHub, repo: str, model_dir: Path) -> None:
    api = HfApi()
    hub_env.tree_page_size = 2

    assert sorted(api.list_repo_files(repo)) == ALL_FILES
    assert len([r for r in hub_env.requests if "/tree/" in r.path]) == 4  # 7 files + 1 folder, 2 a page
    top = {e.path: type(e) for e in api.list_repo_tree(repo)}
    assert top["extra"] is RepoFolder and "extra/notes.txt" not in top
    assert [e.path for e in api.list_repo_tree(repo, path_in_repo="extra")] == ["extra/notes.txt"]
    info = {e.path: type(e) for e in api.get_paths_info(repo, ["config.json", "extra", "nope.txt"])}
    assert info == {"config.json": RepoFile, "extra": RepoFolder}

    model = api.model_info(repo, files_metadata=True)
    assert model.sha == hub_env.commit_sha(repo)
    sizes = {s.rfilename: s.size for s in model.siblings or []}
    assert sizes == {name: (model_dir / name).stat().st_size for name in ALL_FILES}
    lfs = {s.rfilename: s.lfs.sha256 for s in model.siblings or [] if s.lfs}
    assert lfs == {shard: sha256(model_dir / shard) for shard in SHARDS}
    assert model.safetensors is not None and model.safetensors.parameters["F32"] == 1024 * 768 + 128 * 512 + 512


def test_a_new_commit_leaves_the_old_one_reachable(hub_env: FakeHub, repo: str, model_dir: Path) -> None:
    old = hub_env.commit_sha(repo)
    assert hub_env.add_repo(repo, model_dir) == old  # nothing changed: no new commit

    new = hub_env.add_file(repo, "config.json", b'{"model_type": "mistral"}')

    assert new != old and re.fullmatch(r"[0-9a-f]{40}", new)
    assert json.loads(Path(hf_hub_download(repo, "config.json")).read_text())["model_type"] == "mistral"
    assert json.loads(Path(hf_hub_download(repo, "config.json", revision=old)).read_text())["model_type"] == "llama"
    assert HfApi().model_info(repo, revision=old).sha == old


def test_hub_env_points_the_client_and_subprocesses_at_the_hub(hub_env: FakeHub, repo: str) -> None:
    hf_home = Path(os.environ["HF_HOME"])
    assert str(hf_home / "hub") == constants.HF_HUB_CACHE
    assert hf_hub_url(repo, "config.json").startswith(hub_env.endpoint + "/")

    script = f"from huggingface_hub import hf_hub_download; print(hf_hub_download({repo!r}, 'config.json'))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)

    assert Path(out.stdout.strip()).is_relative_to(hf_home / "hub")
    assert [(r.method, r.filename) for r in hub_env.requests] == [("HEAD", "config.json"), ("GET", "config.json")]
