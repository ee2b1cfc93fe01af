"""The test cluster itself: ssh hosts in network namespaces, and a real mlx.launch ring across two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.cluster import Cluster

pytestmark = pytest.mark.cluster

MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
RING_SCRIPT = """\
import mlx.core as mx
group = mx.distributed.init(strict=True)
total = mx.distributed.all_sum(mx.array([group.rank() + 1.0]))
print(f"rank {group.rank()} of {group.size()}: all_sum={total.item():.0f}", flush=True)
"""


def test_ssh_through_the_wrapper_reaches_each_host(cluster: Cluster) -> None:
    for i, address in enumerate(cluster.hosts):
        # The command runs in that host's namespace: the address it sees on eth0 is its own.
        out = cluster.ssh(address, "ip -o -4 addr show dev eth0; echo HOME=$HOME").stdout
        assert f"inet {address}/24" in out
        assert f"HOME={cluster.host(i).home}" in out


def test_plain_ssh_on_path_is_the_wrapper(cluster: Cluster) -> None:
    # What mlx.launch and mlxpipe run: `ssh host cmd`, no password, no prompt.
    proc = subprocess.run(
        ["ssh", "-o", "BatchMode=yes", cluster.hosts[0], "echo", "ok"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30,
    )
    assert (proc.returncode, proc.stdout) == (0, "ok\n")


def test_hosts_reach_each_other(cluster: Cluster) -> None:
    first, second = cluster.hosts[:2]
    out = cluster.ssh(first, f"ssh {second} 'ip -o -4 addr show dev eth0'").stdout
    assert f"inet {second}/24" in out


def test_run_on_runs_inside_the_hosts_namespace(cluster: Cluster) -> None:
    proc = cluster.popen_on(1, ["sleep", "30"])
    try:
        assert [p.pid for p in cluster.ps_on(1)] == [proc.pid]
        assert cluster.ps_on(0) == []
        assert f"inet {cluster.hosts[1]}/24" in cluster.run_on(1, "ip -o -4 addr show dev eth0").stdout
    finally:
        proc.kill()
        proc.wait()


def test_blocked_and_killed_hosts_refuse_ssh_and_are_healed(cluster: Cluster) -> None:
    cluster.kill_sshd(0)
    assert cluster.ssh(0, "true", check=False).returncode == 255
    cluster.block(1)
    assert cluster.ssh(1, "true", options=("-o", "ConnectTimeout=1"), check=False).returncode == 255
    cluster.heal()
    assert cluster.ssh(0, "true").returncode == cluster.ssh(1, "true").returncode == 0


def test_hostfile_gives_each_host_its_own_cache(cluster: Cluster) -> None:
    import json

    path = cluster.hostfile([0, 1, 1], memory_gb=16, python={0: "/usr/bin/python3"})
    hosts = json.loads(path.read_text())
    assert [h["ssh"] for h in hosts] == [cluster.hosts[0], cluster.hosts[1], cluster.hosts[1]]
    assert [h["ips"] for h in hosts] == [[cluster.hosts[0]], [cluster.hosts[1]], [cluster.hosts[1]]]
    assert [h["hf_home"] for h in hosts] == [str(cluster.host(i).hf_home) for i in (0, 1, 1)]
    assert [h["python"] for h in hosts] == ["/usr/bin/python3", sys.executable, sys.executable]
    assert {h["memory_gb"] for h in hosts} == {16}


@pytest.mark.ranks
def test_mlx_launch_ring_across_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "ring.py"
    script.write_text(RING_SCRIPT)
    argv = [MLX_LAUNCH, "--hostfile", str(cluster.hostfile(2)), "--backend", "ring", "--",
            sys.executable, str(script)]
    # mlx.launch needs a stdin pipe, and exits 0 even when a rank fails: judge by the output.
    proc = subprocess.run(argv, input="", capture_output=True, text=True, timeout=60)
    assert "rank 0 of 2: all_sum=3" in proc.stdout, proc.stdout + proc.stderr
    assert "rank 1 of 2: all_sum=3" in proc.stdout, proc.stdout + proc.stderr
    assert cluster.wait_clean(5) == {}


def test_teardown_leaves_nothing_even_after_a_crashed_run(cluster_session: Cluster) -> None:
    from fixtures.cluster import Cluster as Fresh
    from fixtures.cluster import _link_names, _netns_names, built_cluster

    with built_cluster(1) as extra:
        first_sshd = int(extra.host(0).pidfile.read_text())
        # A run that crashed left this slot's namespace, links and sshd: building it again cleans them first.
        again = Fresh(extra.slot, extra.root).up(1)
        assert again.ssh(0, "echo ok").stdout == "ok\n"
        second_sshd = int(extra.host(0).pidfile.read_text())
    assert not [ns for ns in _netns_names() if ns.startswith(f"mxp{extra.slot}-")]
    assert not [link for link in _link_names() if link.startswith(f"mxp{extra.slot}")]
    assert not extra.root.exists()
    for pid in (first_sshd, second_sshd):
        assert not Path(f"/proc/{pid}/exe").exists()
