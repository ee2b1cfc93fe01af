"""``cluster init``'s hostfile from surveyed hosts: backend, addresses, mlxpipe's keys, and the steps left by hand."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from mlxpipe.cluster import init
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.cluster.macos import BRIDGE, ETHERNET, THUNDERBOLT, WIFI, Interface, ThunderboltBus
from mlxpipe.cluster.survey import Machine, Python
from mlxpipe.cluster.thunderbolt import Wiring
from mlxpipe.errors import HostfileError

VERSIONS = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlxpipe": "0.1.0"}
GIB = 1024**3


def iface(device: str, kind: str, *cidrs: str, members: tuple[str, ...] = ()) -> Interface:
    return Interface(device, kind, None, tuple(ipaddress.IPv4Interface(c) for c in cidrs), members=members)


def machine(i: int, *, wifi: bool = True, tb: Sequence[ThunderboltBus] = (), rdma: tuple[str, ...] | None = None,
            sudo: bool = True, extra: Sequence[Interface] = (), pythons: Sequence[Python] = (),
            hf_home: str | None = None) -> Machine:
    interfaces = [iface("en0", ETHERNET, f"10.0.0.{i + 1}/24"), *extra]
    if wifi:
        interfaces.append(iface("en1", WIFI, f"192.168.1.{i + 1}/24"))
    return Machine(f"studio-{i + 1}", f"studio-{i + 1}.local", f"/Users/u{i}", hf_home=hf_home, chip="Apple M3 Ultra",
                   memory_bytes=256 * GIB, macos="26.2", disk_free=GIB, interfaces=tuple(interfaces),
                   thunderbolt=tuple(tb), thunderbolt_devices={"1": "en2", "2": "en3"}, rdma=rdma, sudo=sudo,
                   pythons=tuple(pythons))


def cabled_pair(**kwargs: Any) -> list[Machine]:
    """Two Macs with one Thunderbolt 5 cable, port 1 to port 1."""
    return [machine(0, tb=[ThunderboltBus("1", "A", "B", speed="80 Gb/s")], **kwargs),
            machine(1, tb=[ThunderboltBus("1", "B", "A", speed="80 Gb/s")], **kwargs)]


def no_wiring(hosts: Sequence[str], auto_setup: bool) -> Wiring:
    raise AssertionError("mlx.distributed_config must not run without cables")


def test_no_thunderbolt_ethernet_and_mlxpipes_keys() -> None:
    hosts = [machine(0), machine(1, hf_home="/Volumes/big/hf")]
    out = init.make(hosts, versions=VERSIONS, wire=no_wiring)
    assert out.complete and out.steps == []
    assert out.data == {"backend": "ring", "envs": [], "hosts": [
        {"ssh": "studio-1", "ips": ["10.0.0.1"], "memory_gb": 256, "python": "/Users/u0/.mlxpipe/venv/bin/python",
         "hf_home": "/Users/u0/.cache/huggingface"},
        {"ssh": "studio-2", "ips": ["10.0.0.2"], "memory_gb": 256, "python": "/Users/u1/.mlxpipe/venv/bin/python",
         "hf_home": "/Volumes/big/hf"},
    ]}
    assert out.to_install == ["studio-1", "studio-2"]
    assert out.notes == ["addresses: ethernet (10.0.0.0/24)"]


def test_an_interpreter_with_the_controllers_versions_is_named() -> None:
    right = Python("/opt/homebrew/bin/python3", "3.12.8", dict(VERSIONS))
    venv = Python("/Users/u1/.mlxpipe/venv/bin/python", "3.12.8", dict(VERSIONS), venv=True)
    old = Python("/Users/u0/.mlxpipe/venv/bin/python", "3.12.8", {**VERSIONS, "mlxpipe": "0.0.1"}, venv=True)
    out = init.make([machine(0, pythons=[old, right]), machine(1, pythons=[right, venv])], versions=VERSIONS,
                    wire=no_wiring)
    pythons = [h["python"] for h in out.data["hosts"]]  # type: ignore[index]
    assert pythons == ["/opt/homebrew/bin/python3", "/Users/u1/.mlxpipe/venv/bin/python"]
    assert out.to_install == []
    forced = init.make([machine(0), machine(1)], versions=VERSIONS, python="/usr/bin/python3", wire=no_wiring)
    assert {h["python"] for h in forced.data["hosts"]} == {"/usr/bin/python3"}  # type: ignore[index]


def test_wifi_only_when_no_wire_joins_them() -> None:
    hosts = [machine(0, wifi=True), machine(1, wifi=True, extra=[])]
    hosts[1] = Machine(**{**hosts[1].__dict__, "interfaces": (iface("en0", ETHERNET, "10.9.0.2/24"),
                                                                iface("en1", WIFI, "192.168.1.2/24"))})
    out = init.make(hosts, versions=VERSIONS, wire=no_wiring)
    assert [h["ips"] for h in out.data["hosts"]] == [["192.168.1.1"], ["192.168.1.2"]]  # type: ignore[index]
    assert out.notes == ["addresses: wi-fi (192.168.1.0/24); no wired network joins every host"]


def test_no_shared_network_is_a_blocking_step() -> None:
    hosts = [machine(0, wifi=False),
             Machine("studio-2", "s2", "/Users/u1", interfaces=(iface("en0", ETHERNET, "10.9.0.2/24"),))]
    out = init.make(hosts, versions=VERSIONS, wire=no_wiring)
    assert out.data is None and not out.complete
    (step,) = out.steps
    assert step.blocking and str(step).startswith("on studio-1, studio-2: connect these hosts to one network")


def test_a_cabled_pair_is_wired_by_mlx_and_gets_the_ring_over_thunderbolt() -> None:
    calls: list[tuple[list[str], bool]] = []

    def wire(hosts: Sequence[str], auto_setup: bool) -> Wiring:
        calls.append((list(hosts), auto_setup))
        return Wiring("ring", ({"ssh": "studio-1", "ips": ["192.168.0.1"], "rdma": []},
                               {"ssh": "studio-2", "ips": ["192.168.0.2"], "rdma": []}))

    def resurvey(hosts: Sequence[str]) -> tuple[list[Machine], list[init.Step]]:
        done = cabled_pair(rdma=())
        return [Machine(**{**m.__dict__,
                           "interfaces": (*m.interfaces, iface("en2", THUNDERBOLT, f"192.168.0.{i + 1}/30"))})
                for i, m in enumerate(done)], []

    bridge = iface("bridge0", BRIDGE, "169.254.1.1/16", members=("en2", "en3"))
    hosts = cabled_pair(rdma=(), extra=[bridge])
    out = init.make(hosts, versions=VERSIONS, wire=wire, resurvey=resurvey)
    assert calls == [(["studio-1", "studio-2"], True)]  # passwordless sudo: MLX configures the ports itself
    assert out.complete
    assert out.data["backend"] == "ring"  # type: ignore[index]
    assert [h["ips"] for h in out.data["hosts"]] == [["192.168.0.1"], ["192.168.0.2"]]  # type: ignore[index]
    assert [str(s) for s in out.steps] == [f"on studio-{i}: {init.BRIDGE_STEP}" for i in (1, 2)] + \
        [f"on studio-{i}: {init.RDMA_STEP}" for i in (1, 2)]
    assert not any(s.blocking for s in out.steps)


def test_ports_mlx_could_not_configure_are_the_hosts_own_step() -> None:
    def wire(hosts: Sequence[str], auto_setup: bool) -> Wiring:
        assert auto_setup is False
        return Wiring("ring", ({"ssh": "studio-1", "ips": ["192.168.0.1"], "rdma": []},
                               {"ssh": "studio-2", "ips": ["192.168.0.2"], "rdma": []}),
                      setup={"studio-1": "sudo ifconfig en2 inet 192.168.0.1 netmask 255.255.255.252",
                             "studio-2": "sudo ifconfig en2 inet 192.168.0.2 netmask 255.255.255.252"})

    out = init.make(cabled_pair(rdma=None, sudo=False), versions=VERSIONS, wire=wire,
                    resurvey=lambda hosts: (cabled_pair(rdma=None, sudo=False), []))
    assert not out.complete
    blocking = [str(s) for s in out.steps if s.blocking]
    assert blocking == [f"on studio-{i}: configure its Thunderbolt ports, then run init again (or allow passwordless "
                        f"sudo there and init does it): sudo ifconfig en2 inet 192.168.0.{i} netmask 255.255.255.252"
                        for i in (1, 2)]
    # No ibv_devices at all: macOS older than 26.2.
    assert [str(s) for s in out.steps if not s.blocking] == [f"on studio-{i}: {init.MACOS_STEP}" for i in (1, 2)]


def test_jaccl_keeps_the_rdma_devices_and_takes_the_wired_network_for_its_coordinator() -> None:
    def wire(hosts: Sequence[str], auto_setup: bool) -> Wiring:
        # MLX's ips are en0's: a MacBook's en0 is its Wi-Fi.
        return Wiring("jaccl", ({"ssh": "studio-1", "ips": ["192.168.1.1"], "rdma": [None, "rdma_en2"]},
                                {"ssh": "studio-2", "ips": ["192.168.1.2"], "rdma": ["rdma_en2", None]}))

    out = init.make(cabled_pair(rdma=("rdma_en2", "rdma_en3")), versions=VERSIONS, wire=wire)
    assert out.complete and out.steps == []
    hosts = out.data["hosts"]  # type: ignore[index]
    assert [h["ips"] for h in hosts] == [["10.0.0.1"], ["10.0.0.2"]]
    assert [h["rdma"] for h in hosts] == [[None, "rdma_en2"], ["rdma_en2", None]]


def test_thunderbolt_that_does_not_reach_every_host_is_not_used() -> None:
    hosts = [*cabled_pair(), machine(2)]
    out = init.make(hosts, versions=VERSIONS, wire=no_wiring)
    assert out.data["backend"] == "ring"  # type: ignore[index]
    assert out.notes[0] == ("Thunderbolt: not used, studio-3 not cabled to another host (cable every host in a ring "
                            "or a mesh to use it)")


def test_written_whole_and_valid(tmp_path: Path) -> None:
    out = init.make([machine(0), machine(1)], versions=VERSIONS, wire=no_wiring)
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "cluster.json"
    init.check_and_write(out, path)
    assert json.loads(path.read_text()) == out.data
    assert [h.memory_gb for h in load_hostfile(path).hosts] == [256, 256]
    assert [p.name for p in path.parent.iterdir()] == ["cluster.json"]  # no temporary file left

    out.data["hosts"][0]["ssh"] = "-oProxyCommand=x"  # type: ignore[index]
    path.write_text("before\n")
    with pytest.raises(HostfileError):
        init.check_and_write(out, path)
    assert path.read_text() == "before\n"
