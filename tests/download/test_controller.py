"""``mlxpipe download`` end to end: the fake hub, the real huggingface_hub client, real ranks.

Every rank sits on 127.0.0.1 with an ``hf_home`` of its own, so each behaves
like a machine with its own disk, and its fetch runs as a real subprocess
(``python -m mlxpipe.download.fetch``), as it would over ssh. Metadata is read once per
test before the log is cleared, so the hub's log shows only what the hosts fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.fake_hub import FAKE_TOKEN, FakeHub
from fixtures.hostfiles import load_hostfile_host
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.cli import app
from mlxpipe.cluster import remote
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.download import fetch as fetch_mod
from mlxpipe.hub.client import load_metadata
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan, make_plan

DEMO = "dl/demo"
SHAPED = "dl/demo-shaped"
TINY = "dl/tiny"
MLXPIPE = Path(sys.executable).parent / "mlxpipe"


@pytest.fixture(scope="session")
def repos(fake_hub: FakeHub, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model (30 layers, 10 shards, 114 MB), a tiny llama of the demo's shape (30 layers, 10 shards, a few
    MB) and a tiny llama (6 layers, 6 shards) on the hub. The demo's real bytes are for what is about them (a
    connection dropped mid-file, a full disk); the shaped one for what is about which files each host fetches."""
    tiny = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("dl-tiny") / "tiny", num_layers=6, num_shards=6)
    shaped = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("dl-shaped") / "shaped", num_layers=30,
                                  num_shards=10)
    fake_hub.add_repo(DEMO, demo_model)
    fake_hub.add_repo(SHAPED, shaped)
    fake_hub.add_repo(TINY, tiny)
    return {DEMO: demo_model, SHAPED: shaped, TINY: tiny}


# --- Helpers ------------------------------------------------------------------------------


def write_hostfile(tmp_path: Path, ranks: int, *, memory: list[int] | None = None, **per_rank: Any) -> Path:
    """Ranks on 127.0.0.1, each with its own hf_home (or the storage given per rank)."""
    hosts = []
    for r in range(ranks):
        host: dict[str, Any] = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "hf_home": str(tmp_path / f"host{r}")}
        host.update({k: v[r] for k, v in per_rank.items() if v[r] is not None})
        if "model_dir" in host:
            del host["hf_home"]
        if memory:
            host["memory_gb"] = memory[r]
        hosts.append(host)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    return path


def prime(hub: FakeHub, repo: str) -> ModelMetadata:
    """Read (and cache) the metadata, then forget those requests."""
    meta = load_metadata(repo)
    hub.reset_log()
    return meta


def plan_for(meta: ModelMetadata, hostfile: Path, strategy: str | None = None, split: str | None = None) -> Plan:
    parsed = tuple(int(x) for x in split.split(",")) if split else None
    return make_plan(meta, load_hostfile(hostfile).hosts, strategy=strategy, split=parsed)


def snapshot(hf_home: Path, meta: ModelMetadata) -> Path:
    return hf_home / "hub" / ("models--" + meta.source.replace("/", "--")) / "snapshots" / str(meta.commit)


def listing(directory: Path) -> set[str]:
    """Every file (or link to one) under ``directory``, relative; hidden dirs skipped."""
    if not directory.exists():
        return set()
    return {
        p.relative_to(directory).as_posix() for p in directory.rglob("*")
        if p.is_file() and not p.relative_to(directory).as_posix().startswith(".")
    }


def wanted(plan: Plan, rank: int) -> set[str]:
    return set(plan.ranks[rank].files) | set(plan.support_files)


def content_gets(hub: FakeHub) -> list:
    return [r for r in hub.requests if r.method == "GET" and r.filename]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["download", *args])


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# --- Each rank fetches exactly its files -----------------------------------------------------

SPLITS = {  # (repo, ranks) -> explicit split, in rank order (rank 0 runs the last layers)
    (SHAPED, 2): "20,10", (SHAPED, 3): "4,20,6", (TINY, 2): "1,5", (TINY, 3): "3,2,1",
}


@pytest.mark.parametrize("repo", [SHAPED, TINY])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("strategy", ["even", "memory", "balanced", "split"])
def test_each_rank_fetches_exactly_its_plan(
    hub_env: FakeHub, repos: dict, tmp_path: Path, repo: str, ranks: int, strategy: str
) -> None:
    memory = [16, 32, 64][:ranks] if strategy == "memory" else None
    hostfile = write_hostfile(tmp_path, ranks, memory=memory)
    split = SPLITS[repo, ranks] if strategy == "split" else None
    meta = prime(hub_env, repo)
    plan = plan_for(meta, hostfile, None if split else strategy, split)
    assert plan.strategy == strategy

    flags = ["--split", split] if split else ["--strategy", strategy]
    result = invoke("--model", repo, "--hostfile", str(hostfile), *flags)
    assert result.exit_code == 0, result.output

    for r in range(ranks):
        snap = snapshot(tmp_path / f"host{r}", meta)
        assert listing(snap) == wanted(plan, r), f"rank {r}"
        for name in plan.ranks[r].files:  # each weight file is the hub's blob, named by its sha256
            assert (snap / name).resolve().name == meta.file_sha256[name]
    assert hub_env.bytes_served() == sum(rp.download_bytes for rp in plan.ranks)
    assert len(content_gets(hub_env)) == sum(len(wanted(plan, r)) for r in range(ranks))


def test_ranks_sharing_a_cache_fetch_each_file_once(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    shared = str(tmp_path / "one-disk")
    hostfile = write_hostfile(tmp_path, 3, hf_home=[shared, shared, None])
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    result = invoke("--model", TINY, "--hostfile", str(hostfile), "--json")
    assert result.exit_code == 0, result.output

    hosts = json.loads(result.stdout)["hosts"]
    assert [h["ranks"] for h in hosts] == [[0, 1], [2]]
    both = wanted(plan, 0) | wanted(plan, 1)
    assert listing(snapshot(Path(shared), meta)) == both
    assert hub_env.bytes_served() == sum(meta.file_sizes[f] for f in both) + plan.ranks[2].download_bytes


# --- Idempotence, split changes, and the console script -------------------------------------


def test_console_script_end_to_end_then_a_second_run_moves_nothing(
    hub_env: FakeHub, repos: dict, tmp_path: Path
) -> None:
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, SHAPED)
    plan = plan_for(meta, hostfile)
    argv = [str(MLXPIPE), "download", "--model", SHAPED, "--hostfile", str(hostfile)]

    first = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["fetched_bytes"] == hub_env.bytes_served() == sum(rp.download_bytes for rp in plan.ranks)
    assert [(h["ranks"], h["fetched_bytes"], h["present_bytes"]) for h in report["hosts"]] == [
        ([r], plan.ranks[r].download_bytes, 0) for r in range(2)
    ]

    hub_env.reset_log()
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert last_line(second.stdout) == "Every host already had its files: 0 bytes transferred."
    assert content_gets(hub_env) == [] and hub_env.bytes_served() == 0


def test_changing_the_split_fetches_only_the_files_that_became_needed(
    hub_env: FakeHub, repos: dict, tmp_path: Path
) -> None:
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)
    before, after = plan_for(meta, hostfile, split="4,2"), plan_for(meta, hostfile, split="1,5")
    assert invoke("--model", TINY, "--hostfile", str(hostfile), "--split", "4,2").exit_code == 0
    hub_env.reset_log()

    result = invoke("--model", TINY, "--hostfile", str(hostfile), "--split", "1,5", "--json")
    assert result.exit_code == 0, result.output
    new = [wanted(after, r) - wanted(before, r) for r in range(2)]
    assert new[0] == set() and new[1]  # rank 0 shrank, rank 1 grew
    assert sorted(r.filename for r in content_gets(hub_env)) == sorted(new[1])
    fetched = json.loads(result.stdout)["fetched_bytes"]
    assert fetched == hub_env.bytes_served() == sum(meta.file_sizes[f] for f in new[1])


# --- One rank here, dry runs, JSON ------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--rank", "1"], ["--local"]])
def test_one_rank_fetches_in_this_process_only_its_files(
    hub_env: FakeHub, repos: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str]
) -> None:
    def no_subprocess(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("--rank must not start a host process")

    monkeypatch.setattr(remote, "start", no_subprocess)
    hostfile = write_hostfile(tmp_path, 3)
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    rank = int(flag[1]) if flag[0] == "--rank" else 0  # --local: the first 127.0.0.1 rank
    result = invoke("--model", TINY, "--hostfile", str(hostfile), *flag)
    assert result.exit_code == 0, result.output
    assert [listing(snapshot(tmp_path / f"host{r}", meta)) == wanted(plan, r) for r in range(3)] == [
        r == rank for r in range(3)
    ]
    assert hub_env.bytes_served() == plan.ranks[rank].download_bytes


def test_dry_run_lists_each_hosts_files_and_fetches_nothing(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    text = invoke("--model", TINY, "--hostfile", str(hostfile), "--dry-run")
    data = invoke("--model", TINY, "--hostfile", str(hostfile), "--dry-run", "--json")
    assert text.exit_code == data.exit_code == 0, text.output + data.output
    for name in wanted(plan, 0) | wanted(plan, 1):
        assert name in text.stdout
    assert json.loads(data.stdout) == {
        "model": TINY, "commit": meta.commit, "model_bytes": plan.model_download_bytes,
        "hosts": [
            {"host": "127.0.0.1", "ranks": [r],
             "files": sorted(wanted(plan, r), key=lambda f: (not f.endswith(".json"), f)),
             "bytes": plan.ranks[r].download_bytes}
            for r in range(2)
        ],
    }
    assert hub_env.requests == []
    assert not (tmp_path / "host0").exists() and not (tmp_path / "host1").exists()


def test_json_reports_what_each_host_fetched(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    result = invoke("--model", TINY, "--hostfile", str(hostfile), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["controller"] is None and report["fetched_bytes"] == hub_env.bytes_served()
    for r, host in enumerate(report["hosts"]):
        assert host["path"] == str(snapshot(tmp_path / f"host{r}", meta))
        assert (host["host"], host["ranks"], host["via"]) == ("127.0.0.1", [r], "hub")
        assert set(host["files"]) == set(host["fetched_files"]) == wanted(plan, r)
        assert (host["fetched_bytes"], host["present_bytes"]) == (plan.ranks[r].download_bytes, 0)


# --- Faults -----------------------------------------------------------------------------------


def test_a_connection_dropped_in_a_host_process_resumes(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    shard = "model-00001-of-00010.safetensors"
    size = hub_env.file(DEMO, shard).size
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, DEMO)
    hub_env.drop_connection(DEMO, shard, after_bytes=25 * 2**20)
    result = invoke("--model", DEMO, "--hostfile", str(hostfile), "--split", "29,1")
    assert result.exit_code == 0, result.output
    # Two whole 10 MiB chunks reached the file before the drop: the retry asks for the rest.
    resumed = [(r.range, r.status, r.bytes_sent) for r in content_gets(hub_env) if r.filename == shard and r.range]
    assert resumed == [(f"bytes={20 * 2**20}-", 206, size - 20 * 2**20)]
    for r in range(2):
        path = snapshot(tmp_path / f"host{r}", meta) / shard
        assert hashlib.sha256(path.read_bytes()).hexdigest() == meta.file_sha256[shard]


def test_a_file_corrupted_once_on_a_host_is_refetched(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    shard = "model-00004-of-00006.safetensors"  # layer 3: rank 0 alone
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)  # before the fault: reading shard headers would consume it
    assert [shard in rp.files for rp in plan_for(meta, hostfile).ranks] == [True, False]
    hub_env.corrupt(TINY, shard, times=1)
    result = invoke("--model", TINY, "--hostfile", str(hostfile))
    assert result.exit_code == 0, result.output
    assert [r.filename for r in content_gets(hub_env)].count(shard) == 2
    path = snapshot(tmp_path / "host0", meta) / shard
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta.file_sha256[shard]


def test_a_file_always_corrupted_is_one_error_naming_host_and_file(
    hub_env: FakeHub, repos: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_mod, "BACKOFF_SECONDS", (0.0, 0.0, 0.0))
    shard = "model-00006-of-00006.safetensors"
    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)
    hub_env.corrupt(TINY, shard, times=fetch_mod.ATTEMPTS)
    result = invoke("--model", TINY, "--hostfile", str(hostfile), "--rank", "0")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"error: 127.0.0.1 (rank 0): {shard} from {TINY} did not match the hub's sha256 in "
        f"{fetch_mod.ATTEMPTS} attempts; nothing was kept"
    )
    snap = snapshot(tmp_path / "host0", meta)
    assert not (snap / shard).exists() and not (snap / shard).is_symlink()
    blobs = snap.parent.parent / "blobs"
    assert meta.file_sha256[shard] not in os.listdir(blobs)
    assert not [p for p in blobs.iterdir() if "incomplete" in p.name]


def test_a_missing_repo_is_one_line_with_the_login_hint(hub_env: FakeHub, tmp_path: Path) -> None:
    result = invoke("--model", "dl/no-such-model", "--hostfile", str(write_hostfile(tmp_path, 2)))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"error: dl/no-such-model: no such model repo on {hub_env.endpoint}, or it is private",
        "hint: check the name; if it is private, log in with `hf auth login` or set HF_TOKEN",
    ]


def test_a_gated_repo_is_one_line_with_the_login_hint(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    hub_env.add_repo("dl/gated", repos[TINY], gated=True)
    result = invoke("--model", "dl/gated", "--hostfile", str(write_hostfile(tmp_path, 2)))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: dl/gated is gated: you must accept its terms and be logged in",
        "hint: accept the terms on the model's page, then log in with `hf auth login` or set HF_TOKEN",
    ]


def test_a_host_without_access_is_named_with_how_to_log_in_there(
    hub_env: FakeHub, repos: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub_env.add_repo("dl/gated", repos[TINY], gated=True)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)  # the controller may read the metadata...
    prime(hub_env, "dl/gated")
    monkeypatch.delenv("HF_TOKEN")  # ...but the hosts are not logged in
    result = invoke("--model", "dl/gated", "--hostfile", str(write_hostfile(tmp_path, 2)))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: dl/gated is gated (on 127.0.0.1 (rank 0)): you must accept its terms and be logged in (1 more "
        "host failed)",
        "hint: accept the terms on the model's page, then log in with `hf auth login` or set HF_TOKEN on "
        "127.0.0.1 (rank 0)",
    ]
    assert content_gets(hub_env) == []


@pytest.mark.parametrize("bad", ["../x.safetensors", "/abs/x.safetensors", "sub\\x.safetensors"])
def test_an_index_escaping_the_repo_is_refused_before_any_fetch(
    hub_env: FakeHub, repos: dict, tmp_path: Path, bad: str
) -> None:
    source = tmp_path / "evil"
    shutil.copytree(repos[TINY], source)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = bad
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    repo = "dl/evil-" + hashlib.sha1(bad.encode()).hexdigest()[:8]
    hub_env.add_repo(repo, source)

    result = invoke("--model", repo, "--hostfile", str(write_hostfile(tmp_path, 2)))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"error: {repo}: the weight index names the file {bad!r}, which escapes the model directory"
    )
    # Only the two metadata files were read; no weight, no shard header, nothing on any host.
    # (Their HEADs are not counted: hub.download_file sends a bounded one before the client's own.)
    assert {r.filename for r in hub_env.requests if r.filename} == {"config.json", "model.safetensors.index.json"}
    assert sorted(r.filename for r in hub_env.requests if r.method == "GET" and r.filename) == [
        "config.json", "model.safetensors.index.json"
    ]
    assert not (tmp_path / "host0").exists() and not (tmp_path / "host1").exists()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs, mounted for this test (needs root)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({proc.stderr.strip() or 'mount failed'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_names_host_and_path_and_keeps_no_partial_file(
    hub_env: FakeHub, repos: dict, tmp_path: Path, small_disk: Path
) -> None:
    hostfile = write_hostfile(tmp_path, 2, hf_home=[str(small_disk / "hf"), None])
    meta = prime(hub_env, DEMO)
    result = invoke("--model", DEMO, "--hostfile", str(hostfile))
    assert result.exit_code == 1
    snap = snapshot(small_disk / "hf", meta)
    # config.json and the index fit in 1 MiB, the 3.4 MiB tokenizer does not.
    assert result.stderr.splitlines()[0] == (
        f"error: 127.0.0.1 (rank 0): no space left on the device while writing {snap / 'tokenizer.json'}; "
        "the partial file was removed"
    )
    assert listing(snap) == {"config.json", "model.safetensors.index.json"}
    leftovers = [p.name for p in small_disk.rglob("*") if "incomplete" in p.name or p.name.endswith(".tmp")]
    assert leftovers == []
    assert listing(snapshot(tmp_path / "host1", meta)) == wanted(plan_for(meta, hostfile), 1)  # the other host finished


# --- --from-controller ------------------------------------------------------------------------


def test_from_controller_sends_each_host_only_its_files(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    # Ranks 0 and 1 keep a Hugging Face cache, rank 2 a plain model_dir.
    hostfile = write_hostfile(tmp_path, 3, model_dir=[None, None, str(tmp_path / "models2")])
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    result = invoke("--model", TINY, "--hostfile", str(hostfile), "--from-controller", "--json")
    assert result.exit_code == 0, result.output

    # The hub served each needed file once, to the controller's own cache (which
    # already held the two files read for the metadata).
    union = set().union(*(wanted(plan, r) for r in range(3)))
    cached = {"config.json", "model.safetensors.index.json"}
    assert sorted(r.filename for r in content_gets(hub_env)) == sorted(union - cached)
    controller_snapshot = snapshot(Path(os.environ["HF_HOME"]), meta)
    assert listing(controller_snapshot) == union

    for r in range(2):
        snap = snapshot(tmp_path / f"host{r}", meta)
        assert listing(snap) == wanted(plan, r)
        for name in wanted(plan, r):  # the cache layout: snapshot links into blobs, and the ref
            assert os.readlink(snap / name) == os.readlink(controller_snapshot / name)
        blobs = snap.parent.parent / "blobs"
        assert len(os.listdir(blobs)) == len(wanted(plan, r))
        assert (snap.parent.parent / "refs" / "main").read_text() == meta.commit
    plain = tmp_path / "models2" / TINY
    assert listing(plain) == wanted(plan, 2)
    assert not any((plain / f).is_symlink() for f in wanted(plan, 2))

    report = json.loads(result.stdout)
    controller = report["controller"]
    assert controller["fetched_bytes"] == sum(meta.file_sizes[f] for f in union - cached) == hub_env.bytes_served()
    assert controller["present_bytes"] == sum(meta.file_sizes[f] for f in cached)
    assert [(h["via"], h["fetched_bytes"], h["present_bytes"]) for h in report["hosts"]] == [
        ("copy", plan.ranks[r].download_bytes, 0) for r in range(3)
    ]

    # A second run sends nothing and says so; the hub is not asked for anything.
    hub_env.reset_log()
    again = invoke("--model", TINY, "--hostfile", str(hostfile), "--from-controller")
    assert again.exit_code == 0, again.output
    assert last_line(again.stdout) == "Every host already had its files: 0 bytes transferred."
    assert hub_env.requests == []


def test_from_controller_sends_a_local_model_directory(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    model = str(repos[TINY])
    hostfile = write_hostfile(tmp_path, 3, model_dir=[str(tmp_path / "m0"), str(tmp_path / "m1"), None])
    meta = load_metadata(model)
    plan = plan_for(meta, hostfile)
    result = invoke("--model", model, "--hostfile", str(hostfile), "--from-controller", "--json")
    assert result.exit_code == 0, result.output
    for r in range(2):
        assert listing(tmp_path / f"m{r}" / "tiny") == wanted(plan, r)
    report = json.loads(result.stdout)
    # Rank 2 (127.0.0.1, no model_dir) reads the directory in place: nothing to send.
    assert [(h["via"], h["fetched_bytes"], h["present_bytes"]) for h in report["hosts"]] == [
        ("copy", plan.ranks[0].download_bytes, 0), ("copy", plan.ranks[1].download_bytes, 0),
        ("none", 0, plan.ranks[2].download_bytes),
    ]
    assert report["controller"] is None and hub_env.requests == []
    again = invoke("--model", model, "--hostfile", str(hostfile), "--from-controller")
    assert last_line(again.stdout) == "Every host already had its files: 0 bytes transferred."


def test_a_local_model_needs_from_controller(repos: dict, tmp_path: Path) -> None:
    result = invoke("--model", str(repos[TINY]), "--hostfile", str(write_hostfile(tmp_path, 2)))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: {repos[TINY]} is a local directory: there is nothing to download from the hub",
        "hint: send it to the hosts with `mlxpipe download --from-controller`",
    ]


def test_rank_and_from_controller_conflict(tmp_path: Path) -> None:
    hostfile = str(write_hostfile(tmp_path, 2))
    result = invoke("--model", "org/any", "--hostfile", hostfile, "--rank", "0", "--from-controller")
    assert result.exit_code == 2
    assert "--from-controller sends every host its files; --rank fetches one rank's here" in result.stderr


def test_rsync_recreates_the_cache_layout_exactly(hub_env: FakeHub, repos: dict, tmp_path: Path) -> None:
    """The rsync command, run to a local directory, gives the same tree as the local copy."""
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    from mlxpipe.download import controller as dl

    hostfile = write_hostfile(tmp_path, 2)
    meta = prime(hub_env, TINY)
    plan = plan_for(meta, hostfile)
    assert invoke("--model", TINY, "--hostfile", str(hostfile), "--from-controller").exit_code == 0
    task = dl.host_tasks(plan, meta, load_hostfile(hostfile).hosts)[0]
    s = dl.shipment_for(task, meta, task.job.files)
    argv = remote.rsync_argv(load_hostfile_host("studio-2"), s)
    dest = tmp_path / "via-rsync"
    dest.mkdir()
    local = [a for a in argv[:-1] if a not in ("-e",) and not a.startswith("ssh ")] + [f"{dest}/"]
    subprocess.run(local, check=True)
    copied = tmp_path / "host0" / "hub"
    assert listing(dest) == listing(copied)
    for p in dest.rglob("*"):
        twin = copied / p.relative_to(dest)
        assert p.is_symlink() == twin.is_symlink()
        if p.is_symlink():
            assert os.readlink(p) == os.readlink(twin)


def test_a_model_every_rank_loads_whole_goes_whole_to_each_storage(hub_env: FakeHub, repos: dict,
                                                                    tmp_path: Path) -> None:
    """The draft model of speculative decoding: every file to every (host, storage), once each."""
    from mlxpipe.download import controller as dl

    hostfile = write_hostfile(tmp_path, 3, hf_home=[str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "a")])
    meta = prime(hub_env, TINY)
    tasks = dl.whole_model_tasks(meta, load_hostfile(hostfile).hosts)
    assert [(t.ranks, t.job.hf_home) for t in tasks] == [((0, 2), str(tmp_path / "a")), ((1,), str(tmp_path / "b"))]
    weights = sorted(f.name for f in repos[TINY].glob("*.safetensors"))
    for task in tasks:
        assert sorted(f for f in task.job.files if f.endswith(".safetensors")) == weights
        assert {"config.json", "tokenizer.json"} <= set(task.job.files)
    dl.run_on_hosts(tasks)
    for home in ("a", "b"):
        assert sorted(p.name for p in snapshot(tmp_path / home, meta).glob("*.safetensors")) == weights
