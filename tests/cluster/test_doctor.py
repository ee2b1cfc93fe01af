"""``mlxpipe doctor`` and the preflight: on this machine and on the ssh test cluster."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.cli import REPO, invoke
from fixtures.cluster import skip_or_fail_in_ci
from fixtures.doctor import OTHER_MLX, doctor, failures, statuses
from fixtures.hostfiles import LOCAL
from mlxpipe.cli import app
from mlxpipe.cluster.check_result import CheckResult
from mlxpipe.cluster.doctor import preflight, require_ok, ring_ports
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.errors import LaunchError
from mlxpipe.launch.command import free_port_base

LOCAL_2 = REPO / "hostfiles" / "local-2.json"


def write(path: Path, hosts: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(hosts))
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listening socket for the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# --- This machine -----------------------------------------------------------------------


def test_local_hostfile_passes() -> None:
    code, checks, _ = doctor("--hostfile", str(LOCAL_2))
    assert code == 0
    # Both ranks share one machine and interpreter: one probe, one set of rows for ranks 0 and 1.
    assert [(c["host"], c["ranks"], c["check"], c["status"]) for c in checks] == [
        ("127.0.0.1", [0, 1], "ssh", "ok"),
        ("127.0.0.1", [0, 1], "python", "ok"),
        ("127.0.0.1", [0, 1], "versions", "ok"),
        ("127.0.0.1", [0, 1], "ports", "ok"),
    ]
    import mlx.core as mx

    assert f"mlx {mx.__version__}" in checks[2]["detail"]


def test_table_names_every_check_and_exits_0() -> None:
    result = CliRunner().invoke(app, ["doctor", "--hostfile", str(LOCAL_2)])
    assert result.exit_code == 0, result.output
    for word in ("127.0.0.1 (ranks 0,1)", "ssh", "python", "versions", "ports", "ok"):
        assert word in result.stdout


def test_preflight_of_local_ranks_binds_the_ports_it_will_use() -> None:
    results = preflight(load_hostfile(LOCAL_2), port=free_port_base(2))  # with ports to bind, the most work there is
    assert [r.check for r in results] == ["ssh", "python", "versions", "ports"]
    assert not [r for r in results if r.failed]


def test_interpreter_without_mlx_fails_naming_the_rank(tmp_path: Path) -> None:
    python3 = "/usr/bin/python3"
    if not os.access(python3, os.X_OK):
        pytest.skip(f"{python3} is not installed")
    hostfile = write(tmp_path / "h.json", [LOCAL, {**LOCAL, "python": python3}])
    code, checks, _stderr = doctor("--hostfile", str(hostfile))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["ranks"], bad["check"]) == ([1], "versions")
    assert "mlx" in bad["detail"] and "not installed" in bad["detail"] and python3 in bad["detail"]
    assert python3 in bad["fix"]


def test_missing_interpreter_fails(tmp_path: Path) -> None:
    hostfile = write(tmp_path / "h.json", [LOCAL, {**LOCAL, "python": str(tmp_path / "no-python")}])
    code, checks, _ = doctor("--hostfile", str(hostfile))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["ranks"], bad["check"]) == ([1], "python")
    assert "not found" in bad["detail"] and "'python'" in bad["fix"]


def test_other_mlx_version_fails_naming_both_versions(tmp_path: Path, other_mlx_python: str) -> None:
    import mlx.core as mx

    hostfile = write(tmp_path / "h.json", [LOCAL, LOCAL, {**LOCAL, "python": other_mlx_python}])
    code, checks, _ = doctor("--hostfile", str(hostfile))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["ranks"], bad["check"]) == ([2], "versions")
    assert f"mlx {OTHER_MLX} here, {mx.__version__} on 127.0.0.1" in bad["detail"]
    assert f"mlx=={mx.__version__}" in bad["fix"]


def test_busy_ring_port_fails(busy_port: int) -> None:
    code, checks, _ = doctor("--hostfile", str(LOCAL_2), "--port", str(busy_port))
    assert code == 1
    [bad] = failures(checks)
    assert bad["check"] == "ports"
    assert f"127.0.0.1:{busy_port} Address already in use" in bad["detail"]
    assert "--port" in bad["fix"]


def test_memory_too_small_fails(tmp_path: Path, tiny_models: Any) -> None:
    hostfile = write(tmp_path / "h.json", [{**LOCAL, "memory_gb": 0.001}, {**LOCAL, "memory_gb": 0.001}])
    code, checks, _stderr = doctor("--hostfile", str(hostfile), "--model", str(tiny_models["llama"]))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["host"], bad["ranks"], bad["check"]) == ("127.0.0.1", [0, 1], "memory")
    assert "memory_gb 0.001 in the hostfile" in bad["detail"]
    assert bad["fix"]
    # The same model with real memory: memory and disk pass (a local model on its own machine is all present).
    code, checks, _ = doctor("--hostfile", str(LOCAL_2), "--model", str(tiny_models["llama"]))
    assert code == 0
    assert statuses(checks)[("127.0.0.1", "memory")] == statuses(checks)[("127.0.0.1", "disk")] == "ok"


def test_disk_too_small_fails(tmp_path: Path, tiny_models: Any) -> None:
    small = tmp_path / "small-disk"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "mlxpipe-test", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        skip_or_fail_in_ci(f"cannot mount a small tmpfs: {mounted.stderr.strip()}")
    try:
        hostfile = write(tmp_path / "h.json", [LOCAL, {**LOCAL, "model_dir": str(small)}])
        code, checks, _ = doctor("--hostfile", str(hostfile), "--model", str(tiny_models["llama"]))
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert code == 1
    [bad] = failures(checks)
    assert (bad["ranks"], bad["check"]) == ([1], "disk")
    assert "still to download" in bad["detail"] and "hf_home" in bad["fix"]


def test_ring_ports_follow_mlx_launch(tmp_path: Path) -> None:
    hosts = [{"ssh": "a", "ips": ["10.0.0.1", "10.1.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]
    assert ring_ports(load_hostfile(write(tmp_path / "h.json", hosts)), 40000) == [
        (0, "10.0.0.1", 40000), (0, "10.1.0.1", 40001), (1, "10.0.0.2", 40002),
    ]


def test_require_ok_names_the_first_failure() -> None:
    results = [
        CheckResult("a", (0,), "ssh", "ok", "fine"),
        CheckResult("b", (1,), "ssh", "fail", "cannot connect: Connection refused", "start sshd"),
        CheckResult("c", (2,), "ports", "fail", "busy", "another port"),
    ]
    with pytest.raises(LaunchError) as e:
        require_ok(results)
    assert e.value.message == (
        "preflight: b: ssh: cannot connect: Connection refused (1 more checks failed; see `mlxpipe doctor`)"
    )
    assert e.value.hint == "start sshd"
    require_ok(results[:1])


# --- Doctor: the groups' links through the command line (cluster/layout_checks.py checks them) ----------


def test_doctor_cli_checks_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    result = invoke("doctor", "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    links = [c for c in json.loads(result.stdout)["checks"] if c["check"] == "tp links"]
    assert [(c["ranks"], c["status"]) for c in links] == [([0, 1], "ok")]
    assert "one machine" in links[0]["detail"]


def test_calibrate_goes_with_links() -> None:
    result = invoke("doctor", "--calibrate")
    assert result.exit_code == 2
    assert result.stderr == "error: --calibrate goes with --links\nhint: mlxpipe doctor --links --calibrate\n"
