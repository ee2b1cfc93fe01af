"""``mlxpipe cluster``'s refusals: one line naming the flag, file or host, and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mlxpipe.cli import app


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_init_needs_hosts() -> None:
    result = invoke("cluster", "init", "-o", "x.json")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == (
        "error: no hosts: name them (mlxpipe cluster init HOST ...) or pass --discover"
    )


def test_init_writes_nothing_when_a_host_cannot_be_reached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssh = tmp_path / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text("#!/bin/sh\necho 'ssh: connect to host studio-2 port 22: Connection refused' >&2\nexit 255\n")
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}:/usr/bin:/bin")
    out = tmp_path / "cluster.json"
    result = invoke("cluster", "init", "studio-2", "-o", str(out))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "step: on studio-2: turn on Remote Login on studio-2 (System Settings > General > Sharing), or start its sshd "
        "(cannot connect over ssh: ssh: connect to host studio-2 port 22: Connection refused)"]
    assert f"error: {out} not written: 1 step to do first (above)" in result.stderr
    assert not out.exists()


def test_install_names_a_missing_wheelhouse_and_hostfile(tmp_path: Path) -> None:
    result = invoke("cluster", "install", "--hostfile", str(tmp_path / "h.json"),
                    "--wheelhouse", str(tmp_path / "none"))
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == f"error: --wheelhouse {tmp_path / 'none'}: no such directory"
    result = invoke("cluster", "install", "--hostfile", str(tmp_path / "h.json"))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"error: {tmp_path / 'h.json'}: no such hostfile"


def test_init_and_install_measure_the_links_through_the_links_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxpipe.cli.cluster import _links_job
    from mlxpipe.launch import links_job

    calls: list[Any] = []
    monkeypatch.setattr(links_job, "measure", lambda hostfile, on_progress=None: calls.append(hostfile) or "facts")
    assert _links_job(Path("cluster.json"), quiet=True) == ("facts", None)
    assert calls == [Path("cluster.json")]
