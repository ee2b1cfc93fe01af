"""End to end across ssh hosts: plan, download and generate on the test cluster, and security.

The hosts are network namespaces with their own sshd and disk (``fixtures.cluster``).
A fake hub listens on the cluster's bridge, so hosts can fetch from it directly
when told where it is (each host's ``python`` is a wrapper exporting
``HF_ENDPOINT``, as a real host would have it in its environment); hosts without
that reach no hub and get their files ``--from-controller``. The answer must be
token for token what single-process mlx-lm generates.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.cli import cli
from fixtures.cluster import Cluster
from fixtures.demo_model import DEMO_MAX_TOKENS, DEMO_PROMPT
from fixtures.fake_hub import FakeHub, point_hf_hub_at

REPO_ID = "e2e/demo"
PROMPT, MAX_TOKENS = DEMO_PROMPT, DEMO_MAX_TOKENS
SECRET = "hf_e2e_secret_token_do_not_leak"


# --- Fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridge_hub(cluster_session: Cluster, demo_model: Path) -> Iterator[FakeHub]:
    """A fake hub on the cluster's bridge address: reachable from this machine and every host."""
    with FakeHub(host=cluster_session.gateway) as hub:
        hub.add_repo(REPO_ID, demo_model)
        yield hub


@pytest.fixture
def hub(bridge_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """This machine's huggingface_hub pointed at the bridge hub, for this test."""
    bridge_hub.reset()
    point_hf_hub_at(bridge_hub.endpoint, Path(os.environ["HF_HOME"]), monkeypatch)
    return bridge_hub


@pytest.fixture
def python_with_hub(hub: FakeHub, tmp_path: Path) -> str:
    """An interpreter for the hosts that knows where the hub is."""
    path = tmp_path / "python-with-hub"
    path.write_text(
        "#!/bin/sh\n"
        f"export HF_ENDPOINT={shlex.quote(hub.endpoint)} HF_HUB_DISABLE_TELEMETRY=1\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


class CommandLines:
    """Every command line this process starts, and every one on the machine while it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[list[str]] = []
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        recorder = self

        class RecordingPopen(subprocess.Popen):  # type: ignore[type-arg]
            def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
                recorder.started.append([args] if isinstance(args, str) else [str(a) for a in args])
                super().__init__(args, *rest, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in self.seen:
                    try:
                        with open(f"/proc/{entry}/cmdline", "rb") as f:
                            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                    except OSError:
                        continue
                    if cmdline:
                        self.seen[int(entry)] = cmdline

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def command_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[CommandLines]:
    lines = CommandLines(monkeypatch)
    yield lines
    lines.stop()


def host_files(hf_home: str, commit: str) -> set[str]:
    """The files of the repo in a Hugging Face cache."""
    snapshot = Path(hf_home) / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit
    return {p.name for p in snapshot.iterdir()} if snapshot.is_dir() else set()


# --- plan, download, generate -------------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.cluster
@pytest.mark.parametrize("hosts, from_controller", [(2, False), (3, True)],
                         ids=["2-hosts-direct", "3-hosts-from-controller"])
def test_plan_download_generate(cluster: Cluster, hub: FakeHub, python_with_hub: str, hosts: int,
                                from_controller: bool, demo_reference: list[int], tmp_path: Path,
                                command_lines: CommandLines, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)  # the controller's own login: it must reach no command line
    marker = tmp_path / "injected"
    # Direct: hosts reach the hub (the wrapper), and rank 1 keeps its cache under a name full of shell syntax.
    # From the controller: hosts have no hub at all (their plain interpreter knows none).
    keys: dict[str, Any] = {} if from_controller else {
        "python": python_with_hub,
        "hf_home": {1: f"{cluster.host(1).hf_home}/c;`touch {marker}`;$(touch {marker})"},
    }
    hostfile = cluster.hostfile(hosts, **keys)
    homes = [h["hf_home"] for h in json.loads(hostfile.read_text())]

    plan = cli("plan", "--model", REPO_ID, "--hostfile", str(hostfile), "--json")
    assert plan.exit_code == 0, plan.output
    the_plan = json.loads(plan.stdout)
    assert [(r["rank"], r["host"]) for r in the_plan["ranks"]] == list(enumerate(cluster.hosts[:hosts]))
    assert sum(the_plan["split"]) == 30

    download = cli("download", "--model", REPO_ID, "--hostfile", str(hostfile), "--json",
                   *(["--from-controller"] if from_controller else []))
    assert download.exit_code == 0, download.output
    commit = hub.commit_sha(REPO_ID)
    for r in the_plan["ranks"]:
        # Each host holds its own rank's files, and no other weights.
        expected = set(the_plan["support_files"]) | set(r["files"])
        assert host_files(homes[r["rank"]], commit) == expected
    # Who fetched the weights from the hub: every host its own, or this machine once for all.
    here = host_files(os.environ["HF_HOME"], commit)
    weights = {f for r in the_plan["ranks"] for f in r["files"]}
    if from_controller:
        assert here >= weights
    else:
        assert not here & weights
        per_host = sum(hub.file(REPO_ID, f).size for r in the_plan["ranks"] for f in r["files"])
        assert hub.bytes_served(REPO_ID) >= per_host

    result = cli("generate", "--model", REPO_ID, "--hostfile", str(hostfile), "--prompt", PROMPT,
                 "--max-tokens", str(MAX_TOKENS), "--json", *(["--from-controller"] if from_controller else []))
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["tokens"] == demo_reference
    assert [(r["rank"], r["host"]) for r in answer["ranks"]] == list(enumerate(cluster.hosts[:hosts]))
    assert cluster.wait_clean(5) == {}

    # Security: nothing ran the hostfile's shell syntax, no secret on any command line, no remote code.
    assert not marker.exists()
    command_lines.stop()
    ours = [shlex.join(argv) for argv in command_lines.started]
    assert any("ssh" in line for line in ours) and any("mlx.launch" in line for line in ours)
    assert any("mlxpipe.worker" in line for line in command_lines.seen.values())
    assert not [line for line in ours + list(command_lines.seen.values()) if SECRET in line]
    from mlxpipe.protocol.job import JobSpec

    argv = shlex.split((Path(answer["run_dir"]) / "command.txt").read_text())
    assert SECRET not in shlex.join(argv)
    assert JobSpec.decode(argv[argv.index("--job") + 1]).trust_remote_code is False


# --- Security -----------------------------------------------------------------------------------------


COMMANDS = {
    "plan": [],
    "download": [],
    "generate": ["--prompt", "Hi", "--max-tokens", "1"],
    "doctor": [],
}


@pytest.mark.cluster
@pytest.mark.parametrize("key", ["ssh", "python"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_shell_syntax_in_hostfile_is_rejected_or_harmless(cluster: Cluster, key: str, command: str,
                                                          demo_model: Path, tmp_path: Path) -> None:
    marker = tmp_path / "injected"
    value = {"ssh": f"{cluster.hosts[1]}; touch {marker}", "python": f"python3; touch {marker}"}[key]
    hostfile = cluster.hostfile(2, model_dir=lambda h: h.dir / "models", **{key: {1: value}})
    from_controller = ["--from-controller"] if command == "download" else []
    result = cli(command, "--model", str(demo_model), "--hostfile", str(hostfile), *COMMANDS[command], *from_controller)
    if key == "ssh":  # not a host name: refused before anything runs
        assert result.exit_code == 1
        assert f"'ssh' value {value!r} is not a host name" in result.stderr
    elif command == "plan":  # plan contacts no host
        assert result.exit_code == 0, result.output
    else:  # quoted: the host looks for an interpreter by that odd name, and finds none
        assert result.exit_code == 1, result.output
    assert not marker.exists()
    assert cluster.leftovers() == {}


# --- serve ----------------------------------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.cluster
def test_serve_on_three_ssh_hosts(cluster: Cluster, hub: FakeHub, demo_model: Path, tmp_path: Path) -> None:
    import signal

    import openai
    from mlx_lm import load, stream_generate

    from fixtures.serve_process import ServeProcess

    hostfile = cluster.hostfile(3)
    server = ServeProcess(["--model", REPO_ID, "--hostfile", str(hostfile), "--from-controller"], tmp_path / "serve")
    try:
        health = server.wait_for("ready")
        assert [(r["rank"], r["host"]) for r in health["ranks"]] == list(enumerate(cluster.hosts[:3]))
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": PROMPT}]
        reply = client.chat.completions.create(model=REPO_ID, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    finally:
        code = server.stop(signal.SIGTERM)
    model, tokenizer = load(str(demo_model))
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = list(stream_generate(model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False),
                                    max_tokens=MAX_TOKENS))
    assert reply.choices[0].message.content == "".join(r.text for r in expected)
    assert reply.usage.completion_tokens == len(expected)
    assert code == 143, server.stderr
    assert cluster.wait_clean(5) == {}
