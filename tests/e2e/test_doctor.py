"""``mlxpipe doctor`` on the ssh test cluster: every check passes, and each failure names its host."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from fixtures.cluster import Cluster
from fixtures.doctor import OTHER_MLX, doctor, failures, statuses

# --- The ssh test cluster -----------------------------------------------------------------


@pytest.mark.cluster
def test_cluster_passes(cluster: Cluster, tiny_models: Any) -> None:
    code, checks, _ = doctor("--hostfile", str(cluster.hostfile(3)), "--model", str(tiny_models["llama"]))
    assert code == 0, failures(checks)
    assert {(c["host"], c["check"]) for c in checks} == {
        (h, check) for h in cluster.hosts for check in ("ssh", "python", "versions", "ports", "memory", "disk")
    }
    assert set(statuses(checks).values()) == {"ok"}


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["kill_sshd", "block"])
def test_unreachable_host_fails_naming_it(cluster: Cluster, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A blocked host answers nothing: keep the wait short.
    monkeypatch.setattr("mlxpipe.cluster.doctor.CONNECT_TIMEOUT", 2)
    hostfile = cluster.hostfile(2)
    getattr(cluster, how)(1)
    code, checks, stderr = doctor("--hostfile", str(hostfile))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["host"], bad["check"]) == (cluster.hosts[1], "ssh")
    assert bad["detail"].startswith("cannot connect: ")
    assert cluster.hosts[1] in bad["fix"]
    assert statuses(checks)[(cluster.hosts[0], "versions")] == "ok"
    assert f"error: 1 check failed on {cluster.hosts[1]}" in stderr


@pytest.mark.cluster
def test_cluster_host_with_other_mlx_fails_naming_it(cluster: Cluster, other_mlx_python: str) -> None:
    import mlx.core as mx

    code, checks, _ = doctor("--hostfile", str(cluster.hostfile(3, python={1: other_mlx_python})))
    assert code == 1
    [bad] = failures(checks)
    assert (bad["host"], bad["check"]) == (cluster.hosts[1], "versions")
    assert f"mlx {OTHER_MLX} here, {mx.__version__} on {cluster.hosts[0]}, {cluster.hosts[2]}" in bad["detail"]


@pytest.mark.cluster
def test_cluster_busy_ring_port_fails(cluster: Cluster) -> None:
    address = cluster.hosts[0]
    # SO_REUSEADDR: an earlier test's ring may have left the port in TIME_WAIT.
    hold = ("import socket, sys, time; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 32323)); s.listen(); "
            "print('bound', flush=True); time.sleep(60)")
    holder = cluster.popen_on(0, [sys.executable, "-c", hold, address], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "bound\n"
        code, checks, _ = doctor("--hostfile", str(cluster.hostfile(2)))
    finally:
        holder.kill()
        holder.wait()
    assert code == 1
    [bad] = failures(checks)
    assert (bad["host"], bad["check"]) == (address, "ports")
    assert f"{address}:32323 Address already in use" in bad["detail"]
