"""End to end across ssh hosts: plan, download and generate on the test cluster, and security.

The hosts are network namespaces with their own sshd and disk (``fixtures.cluster``).
A fake hub listens on the cluster's bridge, so hosts can fetch from it directly
when told where it is (each host's ``python`` is a wrapper exporting
``HF_ENDPOINT``, as a real host would have it in its environment); hosts without
that reach no hub and get their files ``--from-controller``. The answer must be
token for token what single-process mlx-lm generates. The model is ``chat_model`` (the demo's tokenizer and
template, and 8 layers each in its own shard, on tiny random weights): these tests are about hosts, files
and processes, not the demo's real weights, whose smoke runs are ``test_generate.py``'s.
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
from fixtures.demo_model import CHAT_LAYERS, DEMO_MAX_TOKENS, DEMO_PROMPT
from fixtures.fake_hub import FakeHub, point_hf_hub_at
from fixtures.option_reference import reference as mlx_lm_reference
from mlxpipe.launch.mlx_launch import LAUNCHER

REPO_ID = "e2e/smollm2-tiny"
PROMPT, MAX_TOKENS = DEMO_PROMPT, DEMO_MAX_TOKENS
SECRET = "hf_e2e_secret_token_do_not_leak"


# --- Fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridge_hub(cluster_session: Cluster, chat_model: Path) -> Iterator[FakeHub]:
    """A fake hub on the cluster's bridge address: reachable from this machine and every host."""
    with FakeHub(host=cluster_session.gateway) as hub:
        hub.add_repo(REPO_ID, chat_model)
        yield hub


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> list[int]:
    """Single-process mlx-lm's greedy tokens for ``PROMPT``, chat-templated: the ground truth."""
    request = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}
    return mlx_lm_reference(chat_model, request)[0]


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


def check_plan(cluster: Cluster, hostfile: Path, hosts: int) -> dict[str, Any]:
    plan = cli("plan", "--model", REPO_ID, "--hostfile", str(hostfile), "--json")
    assert plan.exit_code == 0, plan.output
    the_plan: dict[str, Any] = json.loads(plan.stdout)
    assert [(r["rank"], r["host"]) for r in the_plan["ranks"]] == list(enumerate(cluster.hosts[:hosts]))
    assert sum(the_plan["split"]) == CHAT_LAYERS
    return the_plan


def check_download(hub: FakeHub, hostfile: Path, the_plan: dict[str, Any], from_controller: bool) -> None:
    download = cli("download", "--model", REPO_ID, "--hostfile", str(hostfile), "--json",
                   *(["--from-controller"] if from_controller else []))
    assert download.exit_code == 0, download.output
    homes = [h["hf_home"] for h in json.loads(hostfile.read_text())]
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


def check_no_secret_nor_remote_code(command_lines: CommandLines, run_dir: Path, launched_here: bool) -> None:
    """No secret on any command line (this process's, or any on the machine while the run ran), no remote code."""
    from mlxpipe.protocol.job import JobSpec

    command_lines.stop()
    ours = [shlex.join(argv) for argv in command_lines.started]
    assert any("ssh" in line for line in ours)
    if launched_here:
        assert any(LAUNCHER in line for line in ours)
    assert any(LAUNCHER in line for line in command_lines.seen.values())
    assert any("mlxpipe.worker" in line for line in command_lines.seen.values())
    assert not [line for line in ours + list(command_lines.seen.values()) if SECRET in line]
    argv = shlex.split((run_dir / "command.txt").read_text())
    assert SECRET not in shlex.join(argv)
    assert JobSpec.decode(argv[argv.index("--job") + 1]).trust_remote_code is False


@pytest.mark.ranks
@pytest.mark.cluster
def test_plan_download_generate_on_two_hosts_fetching_from_the_hub(
        cluster: Cluster, hub: FakeHub, python_with_hub: str, reference: list[int], tmp_path: Path,
        command_lines: CommandLines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts reach the hub (the wrapper), and rank 1 keeps its cache under a name full of shell syntax. (Hosts that
    reach no hub get their files --from-controller: ``test_plan_download_serve_on_three_hosts_from_the_controller``.)
    """
    monkeypatch.setenv("HF_TOKEN", SECRET)  # the controller's own login: it must reach no command line
    marker = tmp_path / "injected"
    hostfile = cluster.hostfile(2, python=python_with_hub,
                                hf_home={1: f"{cluster.host(1).hf_home}/c;`touch {marker}`;$(touch {marker})"})
    the_plan = check_plan(cluster, hostfile, 2)
    check_download(hub, hostfile, the_plan, from_controller=False)

    result = cli("generate", "--model", REPO_ID, "--hostfile", str(hostfile), "--prompt", PROMPT,
                 "--max-tokens", str(MAX_TOKENS), "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["tokens"] == reference
    assert [(r["rank"], r["host"]) for r in answer["ranks"]] == list(enumerate(cluster.hosts[:2]))
    assert cluster.wait_clean(5) == {}
    # Security: nothing ran the hostfile's shell syntax, no secret on any command line, no remote code.
    assert not marker.exists()
    check_no_secret_nor_remote_code(command_lines, Path(answer["run_dir"]), launched_here=True)


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
                                                          chat_model: Path, tmp_path: Path) -> None:
    marker = tmp_path / "injected"
    value = {"ssh": f"{cluster.hosts[1]}; touch {marker}", "python": f"python3; touch {marker}"}[key]
    hostfile = cluster.hostfile(2, model_dir=lambda h: h.dir / "models", **{key: {1: value}})
    from_controller = ["--from-controller"] if command == "download" else []
    result = cli(command, "--model", str(chat_model), "--hostfile", str(hostfile), *COMMANDS[command], *from_controller)
    if key == "ssh":  # not a host name: refused before anything runs
        assert result.exit_code == 1
        assert f"'ssh' value {value!r} is not a host name" in result.stderr
    elif command == "plan":  # plan contacts no host
        assert result.exit_code == 0, result.output
    else:  # quoted: the host looks for an interpreter by that odd name, and finds none
        assert result.exit_code == 1, result.output
    assert not marker.exists()
    assert cluster.leftovers() == {}


# --- serve ---------------------------------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.cluster
def test_plan_download_serve_on_three_hosts_from_the_controller(
        cluster: Cluster, hub: FakeHub, chat_model: Path, tmp_path: Path, command_lines: CommandLines,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts that reach no hub (their plain interpreter knows none) get their files from this machine: ``download
    --from-controller``, then ``serve --from-controller`` on the three hosts, its reply mlx-lm's."""
    import signal

    import openai
    from mlx_lm import load, stream_generate

    from fixtures.serve_process import ServeProcess

    monkeypatch.setenv("HF_TOKEN", SECRET)  # the controller's own login: it must reach no command line
    hostfile = cluster.hostfile(3)
    the_plan = check_plan(cluster, hostfile, 3)
    check_download(hub, hostfile, the_plan, from_controller=True)

    server = ServeProcess(["--model", REPO_ID, "--hostfile", str(hostfile), "--from-controller"], tmp_path / "serve")
    try:
        health = server.wait_for("ready")
        assert [(r["rank"], r["host"]) for r in health["ranks"]] == list(enumerate(cluster.hosts[:3]))
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": PROMPT}]
        reply = client.chat.completions.create(model=REPO_ID, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    finally:
        code = server.stop(signal.SIGTERM)
    model, tokenizer = load(str(chat_model))
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = list(stream_generate(model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False),
                                    max_tokens=MAX_TOKENS))
    assert reply.choices[0].message.content == "".join(r.text for r in expected)
    assert reply.usage.completion_tokens == len(expected)
    assert code == 143, server.stderr
    assert cluster.wait_clean(5) == {}
    [run_dir] = [d for d in (tmp_path / "serve" / "mlxpipe" / "runs").iterdir() if (d / "command.txt").exists()]
    check_no_secret_nor_remote_code(command_lines, run_dir, launched_here=False)
