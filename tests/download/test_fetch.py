"""The host side of download (``mlxpipe.download.fetch``), through the real huggingface_hub client.

Every test fetches from the fake hub into a cache of its own; faults (dropped
connections, corrupted bodies) are injected on the wire by the hub.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.fake_hub import FakeHub, point_hf_hub_at
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.download import fetch as fetch_mod
from mlxpipe.download.fetch import FetchJob, check, fetch, is_present
from mlxpipe.errors import DownloadError, HubError, ModelError
from mlxpipe.protocol import wire

TINY = "fetch/tiny"
INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00003.safetensors"


@pytest.fixture(scope="session")
def tiny_repo(fake_hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama (6 layers, 3 shards), served as ``fetch/tiny``."""
    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fetch-tiny") / "tiny", num_layers=6, num_shards=3)
    fake_hub.add_repo(TINY, model)
    return TINY


def job_for(hub: FakeHub, repo: str, files: list[str], tmp_path: Path, **changes) -> FetchJob:
    """A job as the controller builds it: sizes and LFS sha256 from the hub."""
    served = {f: hub.file(repo, f) for f in files}
    fields = dict(
        repo=repo, commit=hub.commit_sha(repo), revision="main", files=tuple(files),
        sizes={f: s.size for f, s in served.items()},
        sha256={f: s.sha256 for f, s in served.items() if s.lfs},
        hf_home=str(tmp_path / "host-hf"), host="studio-2 (rank 1)",
    )
    return FetchJob(**{**fields, **changes})


def content_gets(hub: FakeHub, name: str | None = None) -> list:
    return [r for r in hub.requests if r.method == "GET" and r.filename and name in (None, r.filename)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_mod, "BACKOFF_SECONDS", (0.0, 0.0, 0.0))


# --- The job ------------------------------------------------------------------------------


def test_job_round_trips_through_its_encoding() -> None:
    job = FetchJob("org/m", "a" * 40, ("config.json",), {"config.json": 3}, {}, "~/hf", None, "h (rank 0)", "main")
    assert FetchJob.decode(job.encode()) == job


def test_job_from_a_newer_controller_ignores_unknown_keys() -> None:
    import base64

    data = {**json.loads(base64.b64decode(FetchJob("org/m", None, ("a.json",)).encode())), "future": 1}
    assert FetchJob.decode(base64.b64encode(json.dumps(data).encode()).decode()).files == ("a.json",)


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/passwd", "a\\b.safetensors", "sub/../../x"])
def test_job_refuses_names_that_escape_the_model_directory(bad: str) -> None:
    with pytest.raises(ModelError, match="escapes the model directory"):
        FetchJob("org/m", "a" * 40, ("config.json", bad))


def test_host_refuses_a_tampered_job_before_any_request(hub_env: FakeHub, tiny_repo: str) -> None:
    import base64

    good = json.loads(base64.b64decode(FetchJob(tiny_repo, "a" * 40, ("config.json",)).encode()))
    bad = base64.b64encode(json.dumps({**good, "files": ["../../.ssh/authorized_keys"]}).encode()).decode()
    proc = subprocess.run([sys.executable, "-m", "mlxpipe.download.fetch", "--job", bad],
                          capture_output=True, text=True)
    events = list(wire.iter_events(iter(proc.stdout.splitlines())))
    assert proc.returncode == 1
    assert [e["event"] for e in events] == ["error"]
    assert "escapes the model directory" in events[0]["message"]
    assert hub_env.requests == []


# --- Fetching -----------------------------------------------------------------------------


def test_fetch_lands_verified_files_in_the_standard_cache(hub_env: FakeHub, tiny_repo: str, tmp_path: Path) -> None:
    files = ["config.json", INDEX, SHARD]
    job = job_for(hub_env, tiny_repo, files, tmp_path)
    progress: list[int] = []
    result = fetch(job, progress.append)

    snapshot = Path(result.path)
    repo_dir = tmp_path / "host-hf" / "hub" / "models--fetch--tiny"
    assert snapshot == repo_dir / "snapshots" / job.commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(files)
    shard = snapshot / SHARD
    assert shard.is_symlink() and shard.resolve() == repo_dir / "blobs" / hub_env.file(tiny_repo, SHARD).sha256
    assert sha256(shard) == hub_env.file(tiny_repo, SHARD).sha256
    assert (repo_dir / "refs" / "main").read_text() == job.commit  # found by branch name offline
    assert result.fetched_files == tuple(files) and result.present_files == ()
    assert result.fetched_bytes == sum(progress) == job.total_bytes == hub_env.bytes_served()


def test_second_fetch_finds_everything_present_without_a_request(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path
) -> None:
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path)
    fetch(job)
    hub_env.reset_log()
    result = fetch(job)
    assert (result.fetched_bytes, result.present_bytes) == (0, job.total_bytes)
    assert result.present_files == job.files
    assert hub_env.requests == []


def test_fetch_into_a_plain_model_dir(hub_env: FakeHub, tiny_repo: str, tmp_path: Path) -> None:
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path, hf_home=None,
                  local_dir=str(tmp_path / "models" / TINY))
    result = fetch(job)
    assert Path(result.path) == tmp_path / "models" / TINY
    assert not (Path(result.path) / SHARD).is_symlink()
    assert sha256(Path(result.path) / SHARD) == hub_env.file(tiny_repo, SHARD).sha256
    assert check(job) == (["config.json", SHARD], [])


def test_a_file_of_the_wrong_size_or_blob_is_not_present(hub_env: FakeHub, tiny_repo: str, tmp_path: Path) -> None:
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path)
    fetch(job)
    snapshot = Path(fetch_mod.model_dir(job))
    assert check(job) == (["config.json", SHARD], [])
    # A snapshot entry pointing at a blob that is not the shard's sha256.
    (snapshot / SHARD).unlink()
    (snapshot / SHARD).symlink_to(Path("..", "..", "blobs", "0" * 64))
    (snapshot.parent.parent / "blobs" / ("0" * 64)).write_bytes(b"x" * job.sizes[SHARD])
    assert not is_present(job, SHARD)
    # A truncated config.json.
    config = (snapshot / "config.json").resolve()
    config.write_bytes(config.read_bytes()[:-1])
    assert check(job) == ([], ["config.json", SHARD])


def test_a_dropped_connection_resumes_with_a_range_request(hub_env: FakeHub, tiny_repo: str, tmp_path: Path) -> None:
    size = hub_env.file(tiny_repo, SHARD).size
    hub_env.drop_connection(tiny_repo, SHARD, after_bytes=size // 2)
    job = job_for(hub_env, tiny_repo, [SHARD], tmp_path)
    progress: list[int] = []
    result = fetch(job, progress.append)

    gets = content_gets(hub_env, SHARD)
    assert gets[0].range is None and len(gets) == 2
    resumed_at = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))
    assert gets[1].range == f"bytes={resumed_at}-" and 0 < resumed_at <= size // 2
    assert gets[1].status == 206 and gets[1].bytes_sent == size - resumed_at
    assert sha256(Path(result.path) / SHARD) == hub_env.file(tiny_repo, SHARD).sha256
    assert sum(progress) == size


def test_a_file_corrupted_once_is_refetched_and_verified(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path, no_backoff: None
) -> None:
    hub_env.corrupt(tiny_repo, SHARD, times=1)
    job = job_for(hub_env, tiny_repo, [SHARD], tmp_path)
    progress: list[int] = []
    result = fetch(job, progress.append)
    assert len(content_gets(hub_env, SHARD)) == 2
    assert sha256(Path(result.path) / SHARD) == hub_env.file(tiny_repo, SHARD).sha256
    assert sum(progress) == job.sizes[SHARD]  # the bad attempt's bytes were given back


def test_a_file_always_corrupted_is_an_error_and_never_kept(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path, no_backoff: None
) -> None:
    hub_env.corrupt(tiny_repo, SHARD, times=fetch_mod.ATTEMPTS)
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path)
    with pytest.raises(DownloadError) as info:
        fetch(job)
    assert info.value.message == (
        f"studio-2 (rank 1): {SHARD} from {tiny_repo} did not match the hub's sha256 in {fetch_mod.ATTEMPTS} "
        "attempts; nothing was kept"
    )
    assert len(content_gets(hub_env, SHARD)) == fetch_mod.ATTEMPTS
    repo_dir = tmp_path / "host-hf" / "hub" / "models--fetch--tiny"
    assert not (repo_dir / "snapshots" / job.commit / SHARD).exists()
    assert not (repo_dir / "snapshots" / job.commit / SHARD).is_symlink()
    assert sorted(p.name for p in (repo_dir / "blobs").iterdir()) == [hub_env.file(tiny_repo, "config.json").blob_id]


def test_a_gated_repo_names_the_host_and_how_to_log_in_there(hub_env: FakeHub, tiny_repo: str, tmp_path: Path) -> None:
    gated = "fetch/gated"
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "config.json").write_text("{}")
    hub_env.add_repo(gated, tmp_path / "repo", gated=True)
    job = FetchJob(gated, hub_env.commit_sha(gated), ("config.json",), host="studio-2 (rank 1)")
    with pytest.raises(HubError) as info:
        fetch(job)
    assert info.value.message.startswith(f"{gated} is gated (on studio-2 (rank 1))")
    assert "hf auth login" in info.value.hint and "HF_TOKEN on studio-2 (rank 1)" in info.value.hint


def test_check_mode_reports_present_and_missing_without_network(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path
) -> None:
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path)
    fetch(dataclasses.replace(job, files=("config.json",)))
    hub_env.reset_log()
    proc = subprocess.run([sys.executable, "-m", "mlxpipe.download.fetch", "--check", "--job", job.encode()],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert list(wire.iter_events(iter(proc.stdout.splitlines()))) == [
        {"event": "check", "present": ["config.json"], "missing": [SHARD]}
    ]
    assert hub_env.requests == []


# --- Offline and network faults (the CLI's view of them is in test_offline.py) ----------------


def test_an_offline_job_fetches_nothing_and_names_the_missing_files(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path
) -> None:
    """A host over ssh does not inherit HF_HUB_OFFLINE: the job carries it, and the host obeys it."""
    job = job_for(hub_env, tiny_repo, ["config.json", INDEX, SHARD], tmp_path)
    fetch(dataclasses.replace(job, files=("config.json",)))
    hub_env.reset_log()
    offline_job = FetchJob.decode(dataclasses.replace(job, offline=True).encode())
    assert offline_job.offline
    with pytest.raises(DownloadError) as info:
        fetch(offline_job)
    assert info.value.message == (
        f"studio-2 (rank 1): offline (HF_HUB_OFFLINE=1) and 2 of its 3 files of {tiny_repo} at commit "
        f"{job.commit[:12]} are not in {fetch_mod.model_dir(job)}: {INDEX}, {SHARD}"
    )
    assert hub_env.requests == []
    # Everything present: offline is no obstacle, and still nothing is asked.
    done = fetch(dataclasses.replace(offline_job, files=("config.json",)))
    assert (done.fetched_bytes, done.present_files, hub_env.requests) == (0, ("config.json",), [])


def test_a_tls_failure_is_not_retried(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_backoff: None
) -> None:
    ep = hub_env.endpoint.replace("http://", "https://")  # TLS to a plain-HTTP port: the handshake fails
    job = job_for(hub_env, tiny_repo, ["config.json"], tmp_path)
    point_hf_hub_at(ep, Path(os.environ["HF_HOME"]), monkeypatch)
    calls: list[str] = []
    real = fetch_mod._download

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(fetch_mod, "_download", counting)
    with pytest.raises(HubError) as info:
        fetch(job)
    assert info.value.message.startswith(
        f"{tiny_repo} (on studio-2 (rank 1)): cannot reach the hub at {ep}: the TLS handshake failed ([SSL: "
    )
    assert calls == ["config.json"]  # one attempt: a certificate problem does not pass by itself


def test_a_5xx_storm_is_retried_then_named_without_waiting_on_the_clients_own_retries(
    hub_env: FakeHub, tiny_repo: str, tmp_path: Path, no_backoff: None
) -> None:
    job = job_for(hub_env, tiny_repo, ["config.json", SHARD], tmp_path)
    hub_env.outage(502)
    with pytest.raises(DownloadError) as info:
        fetch(job)
    assert info.value.message == (
        f"studio-2 (rank 1): could not fetch config.json from {tiny_repo} in {fetch_mod.ATTEMPTS} attempts: "
        f"the hub at {hub_env.endpoint} answered 502 Bad Gateway"
    )
    # One bounded HEAD per attempt: huggingface_hub's own retry loop (60 s timeouts, 5 backoffs) never ran.
    head = ("HEAD", f"/{tiny_repo}/resolve/{job.commit}/config.json", 502)
    assert [(r.method, r.path, r.status) for r in hub_env.requests] == [head] * fetch_mod.ATTEMPTS
