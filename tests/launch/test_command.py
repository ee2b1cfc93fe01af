"""launch/command.py: the mlx.launch command line, the lease, the ports and the run directory."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxpipe.cluster.hostfile import parse_hostfile
from mlxpipe.launch.command import (
    MIN_LEASE_SECONDS,
    LaunchSpec,
    default_port,
    free_port_base,
    launch_argv,
    lease_for,
    new_run_dir,
    rank_command,
)
from mlxpipe.launch.supervisor import MAX_LEASE_SECONDS

WORKER = ("-m", "mlxpipe.worker", "--job", "JOB")


def hostfile(hosts: list[dict[str, Any]]) -> Any:
    return parse_hostfile(hosts, Path("h.json"))


LOCAL2 = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2


@pytest.mark.parametrize(("timeout", "lease"), [(1.0, MIN_LEASE_SECONDS), (12.0, 12.0), (600.0, MAX_LEASE_SECONDS)])
def test_the_lease_follows_the_watchdog_within_bounds(timeout: float, lease: float) -> None:
    assert lease_for(timeout) == lease


def test_one_interpreter_runs_the_supervisor_which_runs_the_worker(tmp_path: Path) -> None:
    spec = LaunchSpec(hostfile(LOCAL2), WORKER, lease=7.5, port=40000, env=(("MLX_X", "1"),), run_dir=tmp_path)
    argv = launch_argv(spec)
    assert argv[:3] == [sys.executable, "-m", "mlxpipe.launch.mlx_launch"]  # mlx.launch, its I/O threads sleeping
    assert argv[3:argv.index("--")] == ["--verbose", "--hostfile", str(tmp_path / "hostfile.json"), "--backend", "ring",
                                        "--env", "MLX_X=1", "--starting-port", "40000"]
    python, *rest = argv[argv.index("--") + 1:]
    assert rest == ["-m", "mlxpipe.launch.supervisor", "--lease", "7.5", "--", *WORKER]
    assert rank_command(spec) == [python, *rest]


def test_hosts_with_their_own_interpreters_pick_theirs_by_rank(tmp_path: Path) -> None:
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "python": "/opt/py one/bin/python3"},
             {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "python": "/usr/bin/python3"}]
    command = rank_command(LaunchSpec(hostfile(hosts), WORKER, run_dir=tmp_path))
    assert command[:2] == ["/bin/sh", "-c"] and command[3] == "mlxpipe-rank"
    # Run the dispatch itself, printing each argument on its own line instead of running it: each rank gets
    # its own interpreter, quoted whole.
    script = command[2].replace("exec ", "printf '%s\\n' ")
    for rank, expected in ((0, "/opt/py one/bin/python3"), (1, "/usr/bin/python3")):
        out = subprocess.run(["/bin/sh", "-c", script, "mlxpipe-rank", "-m", "x"], capture_output=True, text=True,
                             env={"MLX_RANK": str(rank), "PATH": "/usr/bin:/bin"}).stdout
        assert out.splitlines() == [expected, "-m", "x"]
    unknown = subprocess.run(["/bin/sh", "-c", command[2], "mlxpipe-rank"], env={"MLX_RANK": "7"})
    assert unknown.returncode == 127


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_local_ranks_get_free_ports_and_a_cluster_gets_mlx_launchs_own() -> None:
    base = free_port_base(3)
    assert 1024 < base < 65000 and all(_bindable(base + i) for i in range(3))
    local = default_port(hostfile(LOCAL2))
    assert all(_bindable(local + i) for i in range(2))
    cluster = hostfile([{"ssh": "studio-1", "ips": ["10.0.0.1"]}, {"ssh": "studio-2", "ips": ["10.0.0.2"]}])
    assert default_port(cluster) == 32323  # mlx.launch's own default starting port


def test_each_run_gets_its_own_directory_under_mlxpipes_home(isolated_home: Path) -> None:
    first, second = new_run_dir(), new_run_dir()
    assert first.is_dir() and first.parent == isolated_home / ".cache" / "mlxpipe" / "runs"
    assert second.is_dir()
