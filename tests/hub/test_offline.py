"""Network faults and ``HF_HUB_OFFLINE=1``, through the CLI and the real huggingface_hub client.

Every fault is made on 127.0.0.1: a closed port (refused), a port that accepts
and never answers (timeout), the fake hub answering 503 to everything (a 5xx
storm), https spoken to the fake hub's plain-HTTP port (TLS), and a name that
does not resolve. For DNS the resolver is stubbed in-process to fail as glibc
does for an unknown name, so no query leaves the machine. Each command must
print exactly one error line naming the host and one hint, and exit 1.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.fake_hub import FakeHub, closed_port_endpoint, point_hf_hub_at, silent_endpoint, silent_listener
from fixtures.hub_errors import COMMANDS, NET_HINT, assert_one_error, invoke_command
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.download import fetch as fetch_mod
from mlxpipe.hub.client import load_metadata

MLXPIPE = Path(sys.executable).parent / "mlxpipe"
STORM_HINT = (
    "hint: the hub is failing on its side: try again in a few minutes; "
    "a model already downloaded works offline with HF_HUB_OFFLINE=1"
)
DNS_HOST = "http://nonexistent.invalid"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("offline") / "llama", num_layers=4, num_shards=2)


@pytest.fixture
def repo(hub_env: FakeHub, model: Path, request: pytest.FixtureRequest) -> str:
    """The tiny checkpoint as a repo whose id is unique to this test."""
    repo_id = "offline/" + re.sub(r"[^\w.-]+", "-", request.node.name).strip("-")[:90]
    hub_env.add_repo(repo_id, model)
    return repo_id


@pytest.fixture
def hf_home() -> Path:
    return Path(os.environ["HF_HOME"])


def go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 for subprocesses and for the copy huggingface_hub read at import."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def write_hostfile(tmp_path: Path, ranks: int = 2) -> Path:
    """Ranks on 127.0.0.1, each with its own hf_home, as machines with their own disks."""
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "hf_home": str(tmp_path / f"host{r}")} for r in range(ranks)]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    return path


@pytest.fixture
def unresolvable(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``*.invalid`` fails to resolve, as glibc's resolver fails for an unknown name, without asking DNS."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield DNS_HOST


# --- The hub cannot be reached: every command, every fault ----------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_refused_connection(command: str, repo: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = closed_port_endpoint()
    point_hf_hub_at(ep, hf_home, monkeypatch)
    result = invoke_command(command, "--model", repo)
    assert_one_error(result, f"error: {repo}: cannot reach the hub at {ep}: connection refused", NET_HINT.format(ep=ep))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_dns_failure(
    command: str, repo: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch, unresolvable: str
) -> None:
    point_hf_hub_at(unresolvable, hf_home, monkeypatch)
    result = invoke_command(command, "--model", repo)
    assert_one_error(
        result,
        f"error: {repo}: cannot reach the hub at {unresolvable}: the name nonexistent.invalid does not resolve (DNS)",
        NET_HINT.format(ep=unresolvable),
    )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_port_that_never_answers_times_out(
    command: str, repo: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with silent_listener() as (ep, connections):
        point_hf_hub_at(ep, hf_home, monkeypatch, etag_timeout=1)
        result = invoke_command(command, "--model", repo)
        asked = connections()
    assert_one_error(
        result, f"error: {repo}: the hub at {ep} did not answer within 1 s",
        f"hint: check the network and HF_ENDPOINT ({ep}); on a slow link raise HF_HUB_ETAG_TIMEOUT; "
        "a model already downloaded works offline with HF_HUB_OFFLINE=1",
    )
    assert asked == 1  # one request, one timeout: no retry loop behind it


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_5xx_storm(command: str, hub_env: FakeHub, repo: str) -> None:
    hub_env.outage(503)
    result = invoke_command(command, "--model", repo)
    assert_one_error(result, f"error: {repo}: the hub at {hub_env.endpoint} answered 503 Service Unavailable",
                     STORM_HINT)
    assert [r.status for r in hub_env.requests] == [503]  # metadata is not retried into the storm


def test_tls_failure(hub_env: FakeHub, repo: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = hub_env.endpoint.replace("http://", "https://")  # TLS to a port that speaks plain HTTP
    point_hf_hub_at(ep, hf_home, monkeypatch)
    result = invoke_command("plan", "--model", repo)
    assert (result.exit_code, result.stdout) == (1, "")
    error, hint = result.stderr.splitlines()
    assert re.fullmatch(
        rf"error: {re.escape(repo)}: cannot reach the hub at {re.escape(ep)}: the TLS handshake failed "
        r"\(\[SSL: WRONG_VERSION_NUMBER\] wrong version number \(_ssl\.c:\d+\)\)",
        error,
    ), error
    assert hint == (
        "hint: check the system clock, the CA certificates (SSL_CERT_FILE) and any proxy on the way (HTTPS_PROXY), "
        f"and that HF_ENDPOINT ({ep}) speaks https"
    )


def test_console_script_prints_no_traceback(repo: str, tmp_path: Path) -> None:
    """A real process: the refused connection and the silent port, with a short HF_HUB_ETAG_TIMEOUT."""
    refused = closed_port_endpoint()
    with silent_endpoint() as silent:
        for ep, error in [
            (refused, f"error: {repo}: cannot reach the hub at {refused}: connection refused"),
            (silent, f"error: {repo}: the hub at {silent} did not answer within 2 s"),
        ]:
            env = {**os.environ, "HF_ENDPOINT": ep, "HF_HUB_ETAG_TIMEOUT": "2"}
            proc = subprocess.run([str(MLXPIPE), *COMMANDS["download"], "--model", repo], capture_output=True,
                                  text=True, env=env, timeout=60)
            assert (proc.returncode, proc.stdout, proc.stderr.splitlines()[0]) == (1, "", error)
            assert len(proc.stderr.splitlines()) == 2 and "Traceback" not in proc.stderr


# --- Faults while the hosts fetch (the metadata is cached) ----------------------------------


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_mod, "BACKOFF_SECONDS", (0.0, 0.0, 0.0))


def test_host_fetch_against_a_refused_port_names_host_and_hub(
    hub_env: FakeHub, repo: str, hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_backoff: None
) -> None:
    load_metadata(repo)  # cached: the controller's part works without the hub
    ep = closed_port_endpoint()
    point_hf_hub_at(ep, hf_home, monkeypatch)
    result = invoke_command("download", "--model", repo, "--hostfile", str(write_hostfile(tmp_path)), "--rank", "0")
    assert_one_error(
        result,
        f"error: 127.0.0.1 (rank 0): could not fetch config.json from {repo} in {fetch_mod.ATTEMPTS} attempts: "
        f"cannot reach the hub at {ep}: connection refused",
        f"hint: check the network of 127.0.0.1 (rank 0) and HF_ENDPOINT ({ep}); a model already downloaded works "
        "offline with HF_HUB_OFFLINE=1; then run download again (it resumes)",
    )


def test_host_fetch_retries_a_silent_hub_only_within_the_window(
    repo: str, hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_backoff: None
) -> None:
    load_metadata(repo)
    monkeypatch.setattr(fetch_mod, "RETRY_WINDOW_SECONDS", 1.5)
    with silent_listener() as (ep, connections):
        point_hf_hub_at(ep, hf_home, monkeypatch, etag_timeout=1)
        result = invoke_command("download", "--model", repo, "--hostfile", str(write_hostfile(tmp_path)), "--rank", "0")
        asked = connections()
    # Attempt 1 ends at ~1 s, inside the window; attempt 2 at ~2 s, past it: no third.
    assert result.stderr.splitlines()[0] == (
        f"error: 127.0.0.1 (rank 0): could not fetch config.json from {repo} in 2 attempts: "
        f"the hub at {ep} did not answer within 1 s"
    )
    assert result.exit_code == 1 and asked == 2


def test_a_5xx_storm_on_every_host_is_retried_then_named(hub_env: FakeHub, repo: str, tmp_path: Path) -> None:
    load_metadata(repo)
    hub_env.reset_log()
    hub_env.outage(503)
    result = invoke_command("download", "--model", repo, "--hostfile", str(write_hostfile(tmp_path)))
    assert_one_error(
        result,
        f"error: 127.0.0.1 (rank 0): could not fetch config.json from {repo} in {fetch_mod.ATTEMPTS} attempts: "
        f"the hub at {hub_env.endpoint} answered 503 Service Unavailable (1 more host failed)",
        STORM_HINT + "; then run download again (it resumes)",
    )
    # Each host process: one bounded HEAD per attempt, then it gives up (backoff 0.5 + 1 + 2 s).
    assert len(hub_env.requests) == 2 * fetch_mod.ATTEMPTS
    assert {r.method for r in hub_env.requests} == {"HEAD"}


# --- HF_HUB_OFFLINE=1 ---------------------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_offline_without_a_cache_says_what_is_missing(
    command: str, hub_env: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    go_offline(monkeypatch)
    result = invoke_command(command, "--model", repo)
    assert_one_error(
        result, f"error: offline (HF_HUB_OFFLINE=1) and no cached metadata for {repo} at revision main",
        f"hint: run `mlxpipe plan --model {repo}` once online",
    )
    assert hub_env.requests == []


def test_offline_with_a_downloaded_model_plan_and_download_work(
    hub_env: FakeHub, repo: str, tmp_path: Path
) -> None:
    """The console script with HF_HUB_OFFLINE=1 (and the hub's port closed, to be sure): no request at all."""
    hostfile = str(write_hostfile(tmp_path))
    online_plan = subprocess.run([str(MLXPIPE), "plan", "--model", repo, "--hostfile", hostfile, "--json"],
                                 capture_output=True, text=True, timeout=60)
    assert online_plan.returncode == 0, online_plan.stderr
    fetched = subprocess.run([str(MLXPIPE), "download", "--model", repo, "--hostfile", hostfile],
                             capture_output=True, text=True, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    hub_env.reset_log()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": closed_port_endpoint()}
    plan = subprocess.run([str(MLXPIPE), "plan", "--model", repo, "--hostfile", hostfile, "--json"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert (plan.returncode, plan.stderr, plan.stdout) == (0, "", online_plan.stdout)
    download = subprocess.run([str(MLXPIPE), "download", "--model", repo, "--hostfile", hostfile],
                              capture_output=True, text=True, env=env, timeout=60)
    assert download.returncode == 0, download.stderr
    assert download.stdout.strip().splitlines()[-1] == "Every host already had its files: 0 bytes transferred."
    assert hub_env.requests == []


def test_offline_download_names_the_files_a_host_lacks(
    hub_env: FakeHub, repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hostfile = str(write_hostfile(tmp_path))
    assert invoke_command("download", "--model", repo, "--hostfile", hostfile).exit_code == 0
    meta = load_metadata(repo)
    snapshot = tmp_path / "host1" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / str(meta.commit)
    lost = sorted(p.name for p in snapshot.glob("*.safetensors"))[0]
    (snapshot / lost).unlink()
    hub_env.reset_log()
    go_offline(monkeypatch)
    result = invoke_command("download", "--model", repo, "--hostfile", hostfile)
    files = len(list(snapshot.iterdir())) + 1
    assert_one_error(
        result,
        f"error: 127.0.0.1 (rank 1): offline (HF_HUB_OFFLINE=1) and 1 of its {files} files of {repo} at commit "
        f"{meta.commit[:12]} are not in {snapshot}: {lost}",
        "hint: run `mlxpipe download` once online, or `mlxpipe download --from-controller` "
        "from a machine that has them",
    )
    assert hub_env.requests == []


def test_offline_resolves_a_branch_through_huggingface_hubs_refs(
    hub_env: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metadata cached under its commit only; huggingface_hub's cache knows main -> that commit."""
    from huggingface_hub import hf_hub_download

    commit = hub_env.commit_sha(repo)
    online = load_metadata(repo, revision=commit)  # mlxpipe's cache: <commit>.json, no ref for main
    hf_hub_download(repo, "config.json")  # the real client records refs/main
    hub_env.reset_log()
    go_offline(monkeypatch)
    result = invoke_command("plan", "--model", repo, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["commit"] == online.commit == commit
    assert hub_env.requests == []


def test_offline_reads_a_snapshot_downloaded_by_huggingface_hub(
    hub_env: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model fetched with ``hf download`` (no mlxpipe metadata at all) plans offline as it does online."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo)
    go_offline(monkeypatch)
    offline = load_metadata(repo)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online again, to compare
    online = load_metadata(repo, refresh=True)
    assert (offline.commit, offline.revision, offline.local) == (online.commit, "main", False)
    assert offline.config == online.config
    assert (offline.file_sizes, offline.support_files) == (online.file_sizes, online.support_files)
    assert set(offline.tensors) == set(online.tensors)
    assert offline.file_sha256 == online.file_sha256  # the LFS blobs' names


def test_offline_with_a_ref_but_no_metadata_names_the_commit(
    hub_env: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import hf_hub_download

    hf_hub_download(repo, "config.json")  # refs/main and one file: not the whole checkpoint
    go_offline(monkeypatch)
    result = invoke_command("plan", "--model", repo)
    assert_one_error(
        result,
        f"error: offline (HF_HUB_OFFLINE=1) and no cached metadata for {repo} at revision main "
        f"(commit {hub_env.commit_sha(repo)[:12]})",
        f"hint: run `mlxpipe plan --model {repo}` once online",
    )


def test_offline_refresh_is_refused(hub_env: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    load_metadata(repo)
    go_offline(monkeypatch)
    result = invoke_command("plan", "--model", repo, "--refresh")
    assert_one_error(
        result, f"error: {repo}: --refresh reads the hub, but HF_HUB_OFFLINE=1 forbids it",
        "hint: drop --refresh to use the cached metadata, or unset HF_HUB_OFFLINE",
    )


def test_an_unreachable_hub_falls_back_to_what_huggingface_hub_cached(
    hub_env: FakeHub, repo: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not offline, but the hub is down: as huggingface_hub does, the cached commit of main is used."""
    from huggingface_hub import hf_hub_download

    commit = hub_env.commit_sha(repo)
    load_metadata(repo, revision=commit)
    hf_hub_download(repo, "config.json")
    point_hf_hub_at(closed_port_endpoint(), hf_home, monkeypatch)
    assert load_metadata(repo).commit == commit
