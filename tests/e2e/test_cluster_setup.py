"""End to end: `mlxpipe cluster discover`, `init` and `install` on test hosts that answer like Macs.

The hosts are the suite's ssh cluster (network namespaces with their own sshd, ``fixtures.cluster``);
``fixtures.macs`` gives each macOS's tools (faked on its PATH, printing recordings in the shape real Macs
print: a Thunderbolt 5 pair of Mac Studios, a Thunderbolt 5 ring of four Mac minis) and, for discovery,
a Bonjour responder advertising ``_ssh._tcp``. ``discover`` runs in a namespace of its own joined to the
hosts' bridge, so its multicast stays on the bridge. No host reaches a package registry: ``install``
works from a wheelhouse made of this machine's own packages. The whole set-up ends with ``doctor``
passing and ``generate`` giving single-process mlx-lm's tokens on the hostfile ``init`` wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.cluster import Cluster, built_cluster
from fixtures.demo_model import DEMO_MAX_TOKENS, DEMO_PROMPT
from fixtures.fake_hub import FakeHub
from fixtures.macs import FakeMac, advertise, clear_macs, make_mac, wifi_address
from fixtures.option_reference import reference
from mlxpipe.cli import app

REPO_ID = "e2e/cluster-setup"
VENV_PYTHON = ".mlxpipe/venv/bin/python"


def cli(*args: str) -> Any:
    """The mlxpipe CLI in this process (PATH has the cluster's ssh wrappers); unexpected exceptions propagate."""
    result = CliRunner().invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture
def macs(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, its hosts' extra addresses removed afterwards (the fakes go with each host's HOME)."""
    clear_macs(cluster)
    yield cluster
    cluster.remove_observer()
    clear_macs(cluster)


@pytest.fixture
def four_macs(cluster_session: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster of four hosts of its own (the session's has three, and other tests count them)."""
    with built_cluster(4) as four:
        monkeypatch.setenv("PATH", four.path_env())
        yield four


@pytest.fixture(scope="module")
def wheels_made_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each wheel this module's installs use is packed (``wheels.pack``) or built (``wheels.own``) for real once,
    and copied when asked again: 25-30 s each on 2 busy cores. The wheelhouse's packs are ``install``'s
    controller wheels later, and the first install's build of mlxpipe's own wheel is the next one's."""
    import shutil

    from mlxpipe.cluster import wheels

    store = tmp_path_factory.mktemp("wheels-made")
    made: dict[tuple[str, str, str], Path] = {}

    def once(real: Any) -> Any:
        def first_or_copy(dist: Any, out_dir: Path) -> Path:
            key = (real.__name__, wheels.normalize(dist.metadata["Name"]), dist.version)
            if key not in made:
                made[key] = real(dist, store / str(len(made)))
            out_dir.mkdir(parents=True, exist_ok=True)
            return Path(shutil.copy2(made[key], out_dir / made[key].name))
        return first_or_copy

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wheels, "own", once(wheels.own))
        patch.setattr(wheels, "pack", once(wheels.pack))
        yield


@pytest.fixture(scope="module")
def wheelhouse(wheels_made_once: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of everything mlxpipe runs on, packed from this machine's installed packages (mlxpipe's own left
    out: `install` packs that itself), as a user would pip download them for hosts without a registry."""
    from importlib.metadata import version

    from mlxpipe.cluster import wheels

    out = tmp_path_factory.mktemp("wheelhouse")
    pins = [f"{name}=={version(name)}" for name in ("mlx", "mlx-lm", "mlxpipe")]
    for dist in wheels.closure(pins):
        if dist.metadata["Name"] != "mlxpipe":
            wheels.pack(dist, out)
    return out


def older_mlxpipe(cluster: Cluster, index: int, tmp_path: Path) -> None:
    """An mlxpipe venv on host ``index`` as an earlier release left it: mlxpipe 0.0.1, no mlx."""
    wheel = tmp_path / "mlxpipe-0.0.1-py3-none-any.whl"
    info = "mlxpipe-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr("mlxpipe/__init__.py", '"""mlxpipe 0.0.1."""\n')
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: mlxpipe\nVersion: 0.0.1\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    venv = cluster.host(index).home / ".mlxpipe" / "venv"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    # No pip in it (ensurepip compiles all of pip: three quarters of a venv's making here); install brings its own.
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-index", "--no-compile", str(wheel)], check=True, capture_output=True, env=env)


def venv_versions(cluster: Cluster, index: int) -> dict[str, str]:
    code = ("import json; from importlib.metadata import version as v; "
            "print(json.dumps({n: v(n) for n in ('mlx', 'mlx-lm', 'mlxpipe')}))")
    out = cluster.ssh(index, f"{cluster.host(index).home}/{VENV_PYTHON} -c \"{code}\"").stdout
    return json.loads(out)


def controller_versions() -> dict[str, str]:
    return {name: version(name) for name in ("mlx", "mlx-lm", "mlxpipe")}


# --- discover ---------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_discover_finds_exactly_the_hosts(macs: Cluster) -> None:
    for i in range(3):
        make_mac(macs, i, FakeMac("studio"))
    responders = [advertise(macs, i, f"studio-{i + 1}", [macs.hosts[i], wifi_address(macs, i)]) for i in range(3)]
    macs.kill_sshd(2)  # Remote Login off on the third: found, but ssh does not work
    netns = macs.add_observer("en0")
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "mlxpipe", "cluster", "discover",
             "--interface", "en0", "--timeout", "2", "--json"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )
    finally:
        for r in responders:
            r.terminate()
            r.wait(10)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["name"] for r in rows] == ["studio-1", "studio-2", "studio-3"]
    for i, row in enumerate(rows[:2]):
        assert row["host"] == f"studio-{i + 1}.local"
        assert row["ssh"] is True and row["ssh_destination"] == macs.hosts[i]
        # The Mac's own report, over ssh: which address is its Ethernet and which its Wi-Fi.
        assert row["addresses"] == {"ethernet": [macs.hosts[i]], "wi-fi": [wifi_address(macs, i)]}
        assert row["chip"] == "Apple M3 Ultra" and row["memory_bytes"] == 256 * 1024**3
    off = rows[2]
    assert off["ssh"] is False and off["addresses"] == {"unknown": [macs.hosts[2], wifi_address(macs, 2)]}
    assert "refused" in off["error"] and "turn on Remote Login" in off["fix"]


@pytest.mark.cluster
def test_discover_with_no_answer_says_what_to_do(macs: Cluster) -> None:
    netns = macs.add_observer("en0")
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "mlxpipe", "cluster", "discover", "-i", "en0",
         "--timeout", "0.5"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1
    assert "error: no Mac answered on en0 within 0.5 s" in done.stderr
    assert "turn on Remote Login" in done.stderr
    bad = cli("cluster", "discover", "--interface", "nosuch0")
    assert bad.exit_code == 2 and "--interface nosuch0: no such interface here" in bad.stderr


# --- init, install, doctor, generate: the whole set-up -------------------------------------------------


@pytest.mark.ranks
@pytest.mark.cluster
def test_init_install_then_doctor_and_generate_on_a_thunderbolt_pair(
        macs: Cluster, hub_env: FakeHub, chat_model: Path, wheelhouse: Path, tmp_path: Path) -> None:
    # Two fresh Mac Studios cabled by Thunderbolt 5: RDMA still off, the Thunderbolt Bridge still there.
    make_mac(macs, 0, FakeMac("studio", "mesh2/studio-1.json"))
    make_mac(macs, 1, FakeMac("studio", "mesh2/studio-2.json"))
    older_mlxpipe(macs, 0, tmp_path)
    h0, h1 = macs.hosts[:2]
    hostfile = tmp_path / "cluster.json"

    init = cli("cluster", "init", h0, h1, "-o", str(hostfile))
    assert init.exit_code == 0, init.output
    data = json.loads(hostfile.read_text())
    homes = [macs.host(i).home for i in range(2)]
    # mlx.distributed_config wired the cable (192.168.0.1 <-> .2 on en2) and chose the ring over Thunderbolt.
    assert data == {"backend": "ring", "envs": [], "hosts": [
        {"ssh": h, "ips": [ip], "memory_gb": 256, "python": f"{home}/{VENV_PYTHON}",
         "hf_home": f"{home}/.cache/huggingface"}
        for h, ip, home in zip((h0, h1), ("192.168.0.1", "192.168.0.2"), homes, strict=True)]}
    lines = init.stdout.splitlines()
    for h in (h0, h1):  # what ssh cannot do, one line per host and step
        assert any(line.startswith(f"step: on {h}: enable RDMA for JACCL") and "rdma_ctl enable" in line
                   for line in lines)
        assert any(line.startswith(f"step: on {h}: remove the Thunderbolt Bridge") for line in lines)
    assert f"wrote {hostfile} (2 hosts)" in lines
    # The hosts lack this machine's mlx until install: the links job cannot run there yet.
    assert (f"links: not measured yet: after `mlxpipe cluster install`, `mlxpipe doctor --links --hostfile {hostfile}` "
            "measures them") in lines
    assert f"next: mlxpipe cluster install --hostfile {hostfile}  (mlxpipe, mlx and mlx-lm for {h0}, {h1})" in lines

    install = cli("cluster", "install", "--hostfile", str(hostfile), "--wheelhouse", str(wheelhouse))
    assert install.exit_code == 0, install.output
    for i, h in enumerate((h0, h1)):
        assert any(line.startswith(f"{h}: installed: ") and "(from the wheelhouse" in line
                   for line in install.stdout.splitlines()), install.output
        assert venv_versions(macs, i) == controller_versions()
    assert f"{h0}: creating ~/.mlxpipe/venv" not in install.stderr  # host 0 had one: upgraded in place
    assert f"{h1}: creating ~/.mlxpipe/venv with Python 3." in install.stderr
    assert json.loads(hostfile.read_text()) == data  # the python keys already named the venvs

    doctor = cli("doctor", "--hostfile", str(hostfile), "--json")
    assert doctor.exit_code == 0, doctor.output
    checks = json.loads(doctor.stdout)["checks"]
    assert {(c["host"], c["check"], c["status"]) for c in checks} >= {(h, "versions", "ok") for h in (h0, h1)}

    hub_env.add_repo(REPO_ID, chat_model)  # the set-up, not real weights: chat_model, at a tiny model's speed
    result = cli("generate", "--model", REPO_ID, "--hostfile", str(hostfile), "--prompt", DEMO_PROMPT,
                 "--max-tokens", str(DEMO_MAX_TOKENS), "--from-controller", "--json")
    assert result.exit_code == 0, result.output
    request = {"messages": [{"role": "user", "content": DEMO_PROMPT}], "max_tokens": DEMO_MAX_TOKENS}
    assert json.loads(result.stdout)["tokens"] == reference(chat_model, request)[0]
    assert macs.wait_clean(5) == {}

    again = cli("cluster", "install", "--hostfile", str(hostfile), "--json")  # no wheelhouse, no registry: none needed
    assert again.exit_code == 0, again.output
    report = json.loads(again.stdout)
    assert [(r["host"], r["status"]) for r in report["hosts"]] == [(h0, "unchanged"), (h1, "unchanged")]
    assert report["hostfile_updated"] == []


# --- init on a ring with RDMA, and what it refuses -----------------------------------------------------------


@pytest.mark.ranks  # init measures the links by a real MLX job: these hosts run this machine's mlx already
@pytest.mark.cluster
def test_init_on_a_thunderbolt_ring_of_four_with_rdma(four_macs: Cluster, tmp_path: Path) -> None:
    macs = four_macs
    for i in range(4):
        make_mac(macs, i, FakeMac("mini", f"ring4/mini-{i + 1}.json", rdma=True, bridge=False))
    hostfile = tmp_path / "ring.json"
    init = cli("cluster", "init", *macs.hosts[:4], "-o", str(hostfile), "--python", sys.executable, "--json")
    assert init.exit_code == 0, init.output
    report = json.loads(init.stdout)
    assert report["steps"] == []  # RDMA on, no bridge, passwordless sudo: nothing left to do by hand
    data = json.loads(hostfile.read_text())
    assert data["backend"] == "jaccl-ring"
    hosts = data["hosts"]
    assert [h["ssh"] for h in hosts] == macs.hosts[:4]
    # JACCL's ips name the coordinator: Ethernet, not the Wi-Fi subnet every host is also on.
    assert [h["ips"] for h in hosts] == [[a] for a in macs.hosts[:4]]
    # Each mini talks RDMA to its two neighbours only: port 1 (en2) to the next, port 2 (en3) to the previous.
    assert hosts[0]["rdma"] == [None, "rdma_en2", None, "rdma_en3"]
    assert hosts[1]["rdma"] == ["rdma_en3", None, "rdma_en2", None]
    assert {h["memory_gb"] for h in hosts} == {64}
    assert report["hosts"][0]["chip"] == "Apple M4 Pro" and report["hosts"][0]["macos"] == "26.2"
    doctor = cli("doctor", "--hostfile", str(hostfile))
    assert doctor.exit_code == 0, doctor.output


@pytest.mark.cluster
def test_init_writes_nothing_until_every_host_is_ready(macs: Cluster, tmp_path: Path) -> None:
    hostfile = tmp_path / "cluster.json"
    hostfile.write_text("{}\n")  # an earlier file stays as it was
    for i in range(2):  # a cabled pair whose owner has no passwordless sudo
        make_mac(macs, i, FakeMac("studio", f"mesh2/studio-{i + 1}.json", sudo=False))
    make_mac(macs, 2, FakeMac("studio"))
    macs.kill_sshd(2)  # Remote Login off

    off = cli("cluster", "init", *macs.hosts[:3], "-o", str(hostfile))
    assert off.exit_code == 1
    step = [line for line in off.stdout.splitlines() if line.startswith("step: ")]
    assert len(step) == 1 and step[0].startswith(f"step: on {macs.hosts[2]}: turn on Remote Login on {macs.hosts[2]}")
    assert f"error: {hostfile} not written: 1 step to do first" in off.stderr

    manual = cli("cluster", "init", *macs.hosts[:2], "-o", str(hostfile))
    assert manual.exit_code == 1
    for h, ip, peer in ((macs.hosts[0], "192.168.0.1", "192.168.0.2"), (macs.hosts[1], "192.168.0.2", "192.168.0.1")):
        found = [line for line in manual.stdout.splitlines() if line.startswith(f"step: on {h}: configure")]
        assert len(found) == 1, manual.output
        line = found[0]
        # mlx.distributed_config's own commands for that host, to run there.
        assert line.endswith(f"sudo ifconfig bridge0 down ; sudo ifconfig en2 inet {ip} netmask 255.255.255.252 ; "
                             f"sudo route change {peer} -interface en2")
    assert hostfile.read_text() == "{}\n"


@pytest.mark.ranks  # install measures the links by a real MLX job once the hosts run mlx
@pytest.mark.cluster
def test_install_without_a_registry_uses_the_controllers_wheels(macs: Cluster, wheels_made_once: None,
                                                                 tmp_path: Path) -> None:
    make_mac(macs, 2, FakeMac("studio"))
    hostfile = macs.hostfile([2], name="one.json", python=None)  # no python key: install adds it
    install = cli("cluster", "install", "--hostfile", str(hostfile))
    assert install.exit_code == 0, install.output
    h = macs.hosts[2]
    assert f"{h}: installing from the host's package registry" in install.stderr
    assert f"{h}: no registry (" in install.stderr  # the hosts reach nothing but the bridge
    assert any(line.startswith(f"{h}: installed: ") and line.endswith("(from the controller's wheels)")
               for line in install.stdout.splitlines()), install.output
    assert venv_versions(macs, 2) == controller_versions()
    # The venv was made without pip; the controller's pip, which ran the install from its wheel, is in it now.
    pip = macs.ssh(2, f"{macs.host(2).home}/{VENV_PYTHON} -m pip --version").stdout
    assert pip.startswith(f"pip {version('pip')} from {macs.host(2).home}/.mlxpipe/venv/"), pip
    assert json.loads(hostfile.read_text())[0]["python"] == f"{macs.host(2).home}/{VENV_PYTHON}"
    assert f"{hostfile}: python now names the venv for {h}" in install.stdout
