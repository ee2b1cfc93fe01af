"""The survey: its shell script run here with macOS's tools faked on PATH, and what it reads from their output."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from mlxpipe.cluster import survey
from mlxpipe.cluster.macos import ETHERNET, THUNDERBOLT, WIFI
from mlxpipe.errors import SetupError
from mlxpipe.host import Host

MACS = Path(__file__).parent.parent / "fixtures" / "macs"

IFCONFIG = """\
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 10.0.0.5 netmask 0xffffff00 broadcast 10.0.0.255
\tstatus: active
en1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 192.168.1.5 netmask 0xffffff00 broadcast 192.168.1.255
\tstatus: active
"""


def fake_tools(bin_dir: Path, tools: dict[str, str]) -> None:
    """Shell scripts printing fixed text, one per tool (a missing tool is missing on PATH too)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\nprintf '%s' {shlex.quote(text)}\n")
        path.chmod(0o755)


@pytest.fixture
def mac_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH starting with fakes of a Mac Studio's tools (RDMA enabled, no sudo), and a python3 of this interpreter."""
    bin_dir = tmp_path / "bin"
    fake_tools(bin_dir, {
        "sysctl": "Apple M3 Ultra\n274877906944\n",
        "sw_vers": (MACS / "studio" / "sw_vers.txt").read_text(),
        "networksetup": (MACS / "studio" / "hardware_ports.txt").read_text(),
        "system_profiler": (MACS / "mesh2" / "studio-1.json").read_text(),
        "ibv_devices": (MACS / "studio" / "ibv_devices.txt").read_text(),
        "ifconfig": IFCONFIG,
        "hostname": "studio-1.local\n",
    })
    (bin_dir / "sudo").write_text("#!/bin/sh\necho 'sudo: a password is required' >&2\nexit 1\n")
    (bin_dir / "sudo").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def test_survey_of_a_mac(mac_path: Path) -> None:
    m = survey.survey(Host(0, "127.0.0.1"))  # this machine: the script runs without ssh
    assert (m.hostname, m.chip, m.memory_bytes, m.macos) == ("studio-1.local", "Apple M3 Ultra", 274877906944, "26.2")
    assert m.home and m.disk_free and m.disk_free > 0
    kinds = {i.device: i.kind for i in m.interfaces}
    assert kinds == {"en0": ETHERNET, "en1": WIFI}
    assert len(m.thunderbolt) == 6 and m.thunderbolt_devices["1"] == "en2"
    assert m.rdma == tuple(f"rdma_en{i}" for i in range(2, 8))
    assert m.sudo is False
    assert m.venv_python == f"{m.home.rstrip('/')}/.mlxpipe/venv/bin/python"
    (python,) = [p for p in m.pythons if Path(p.path).name == "python3"]
    assert python.packages["mlxpipe"] is not None and python.minor == sys.version_info[:2]


def test_a_mac_without_ibv_devices_is_one_before_macos_26_2(mac_path: Path) -> None:
    (mac_path / "ibv_devices").unlink()
    assert survey.survey(Host(0, "127.0.0.1")).rdma is None


def test_read_survey_sections() -> None:
    text = "\n".join([
        "@@mlxpipe hostname 0", "mini-1.local",
        "@@mlxpipe home 0", "/Users/me",
        "@@mlxpipe hf_home 0", "/Volumes/models/hf",
        "@@mlxpipe sysctl 1", "",  # sysctl failed: no chip, no memory
        "@@mlxpipe meminfo 0", "MemTotal:       16314456 kB",
        "@@mlxpipe ifconfig 0", *IFCONFIG.splitlines(),
        "@@mlxpipe ports 0", "Hardware Port: Ethernet", "Device: en0", "", "Hardware Port: Wi-Fi", "Device: en1",
        "@@mlxpipe ibv_devices 127", "",
        "@@mlxpipe sudo 0", "",
        "@@mlxpipe python 0", '{"executable": "/Users/me/.mlxpipe/venv/bin/python", "version": "3.12.8", '
                              '"venv": true, "platform": "macosx-14.0-arm64", '
                              '"packages": {"mlx": "0.30.1", "mlx-lm": null, "mlxpipe": null}}',
        "@@mlxpipe python 0", "not json",
        "@@mlxpipe python 1", "",
    ])
    m = survey.read_survey("mini-1", text)
    assert (m.hostname, m.home, m.hf_home, m.chip) == ("mini-1.local", "/Users/me", "/Volumes/models/hf", None)
    assert m.memory_bytes == 16314456 * 1024
    assert [i.kind for i in m.interfaces] == [ETHERNET, WIFI]
    assert m.rdma is None and m.sudo is True and m.macos is None
    (python,) = m.pythons
    assert python.venv and python.minor == (3, 12) and python.platform == "macosx-14.0-arm64"
    assert m.python("/Users/me/.mlxpipe/venv/bin/python") is python
    assert THUNDERBOLT not in {i.kind for i in m.interfaces}


def test_a_host_ssh_cannot_reach_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(tmp_path / "bin", {})
    (tmp_path / "bin" / "ssh").write_text("#!/bin/sh\n"
                                          "echo 'ssh: connect to host studio-9 port 22: Connection refused' >&2\n"
                                          "exit 255\n")
    (tmp_path / "bin" / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    with pytest.raises(SetupError) as e:
        survey.survey(Host(0, "studio-9"))
    assert e.value.message == (
        "studio-9: cannot connect over ssh: ssh: connect to host studio-9 port 22: Connection refused"
    )
    assert e.value.hint is not None and e.value.hint.startswith("turn on Remote Login on studio-9")
