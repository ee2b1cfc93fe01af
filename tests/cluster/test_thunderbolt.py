"""Thunderbolt cables between surveyed hosts, and what mlx.distributed_config prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlxpipe.cluster import macos, thunderbolt
from mlxpipe.cluster.survey import Machine
from mlxpipe.errors import SetupError

MACS = Path(__file__).parent.parent / "fixtures" / "macs"


def mac(ssh: str, recording: str | None, model: str = "mini") -> Machine:
    ports = macos.parse_hardware_ports((MACS / model / "hardware_ports.txt").read_text())
    buses = macos.parse_thunderbolt((MACS / recording).read_text()) if recording else ()
    return Machine(ssh, ssh, "/Users/me", thunderbolt=buses, thunderbolt_devices=macos.thunderbolt_devices(ports))


def test_the_ring_of_four_has_four_cables_port_1_to_the_next_port_2() -> None:
    ring = [mac(f"mini-{i}", f"ring4/mini-{i}.json") for i in range(1, 5)]
    cables = thunderbolt.cables(ring)
    assert sorted((c.a, c.b) for c in cables) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    first = next(c for c in cables if (c.a, c.b) == (0, 1))
    assert (first.a_device, first.b_device, first.generation) == ("en2", "en3", 5)
    assert thunderbolt.uncabled(ring, cables) == []


def test_the_pair_has_one_cable_and_a_third_mac_is_left_out() -> None:
    hosts = [mac("studio-1", "mesh2/studio-1.json", "studio"), mac("studio-2", "mesh2/studio-2.json", "studio"),
             mac("mini-1", None)]
    cables = thunderbolt.cables(hosts)
    assert [(c.a, c.b, c.a_device, c.b_device) for c in cables] == [(0, 1, "en2", "en2")]
    assert thunderbolt.uncabled(hosts, cables) == [2]


def test_cables_to_macs_outside_the_hosts_do_not_count() -> None:
    # mini-1 and mini-3 of the ring: each is cabled, but to mini-2 and mini-4, not to each other.
    hosts = [mac("mini-1", "ring4/mini-1.json"), mac("mini-3", "ring4/mini-3.json")]
    assert thunderbolt.cables(hosts) == []


SETUP_OUTPUT = """\
Setup for studio-1.local
========================
sudo ifconfig bridge0 down
sudo ifconfig en2 inet 192.168.0.1 netmask 255.255.255.252
sudo route change 192.168.0.2 -interface en2

Enter to continue
Setup for studio-2.local
========================
sudo ifconfig bridge0 down
sudo ifconfig en2 inet 192.168.0.2 netmask 255.255.255.252
sudo route change 192.168.0.1 -interface en2

Enter to continue
"""


def test_the_setup_it_prints_per_host() -> None:
    assert thunderbolt.parse_setup(SETUP_OUTPUT) == [
        ("studio-1.local", "sudo ifconfig bridge0 down ; sudo ifconfig en2 inet 192.168.0.1 netmask 255.255.255.252 ; "
                           "sudo route change 192.168.0.2 -interface en2"),
        ("studio-2.local", "sudo ifconfig bridge0 down ; sudo ifconfig en2 inet 192.168.0.2 netmask 255.255.255.252 ; "
                           "sudo route change 192.168.0.1 -interface en2"),
    ]
    assert thunderbolt.parse_setup("Running auto setup for studio-1.local\n") == []


def test_enter_is_pressed_only_when_asked(tmp_path: Path) -> None:
    # A child that, like mlx.distributed_config, first runs something that drains its stdin, then asks twice.
    script = tmp_path / "asks.py"
    script.write_text(
        "import subprocess, sys\n"
        "subprocess.run(['timeout', '0.3', 'cat'])\n"  # would swallow an Enter written ahead
        "print('Setup for a'); print('='*11); print('cmd a'); print()\n"
        "input('Enter to continue'); print()\n"
        "print('Setup for b'); print('='*11); print('cmd b'); print()\n"
        "input('Enter to continue'); print()\n"
        "print('done')\n"
    )
    code, out, err = thunderbolt._run_answering([sys.executable, str(script)], timeout=30)
    assert code == 0, err
    assert out.splitlines()[-1] == "done"
    assert thunderbolt.parse_setup(out) == [("a", "cmd a"), ("b", "cmd b")]


def test_its_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "mlx.distributed_config"
    fake.write_text("#!/bin/sh\nprintf '\\033[31m[ERROR] Could not find a full ring. \\033[0m\\n' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(thunderbolt, "config_command", lambda: str(fake))
    with pytest.raises(SetupError) as e:
        thunderbolt.wire(["a", "b"], auto_setup=False)
    assert e.value.message == "mlx.distributed_config failed (exit status 1): Could not find a full ring."
