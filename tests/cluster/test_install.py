"""``cluster install``'s pieces that need no host: the base interpreter, the platform check, the hostfile's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mlxpipe.cluster import install
from mlxpipe.cluster.install import FAILED, INSTALLED, UNCHANGED, ControllerEnv, Installed
from mlxpipe.cluster.survey import Machine, Python
from mlxpipe.errors import SetupError

ENV = ControllerEnv((3, 12), {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlxpipe": "0.1.0"}, "macosx-14.0-arm64")


def py(path: str, version: str, venv: bool = False, platform: str = "macosx-14.0-arm64") -> Python:
    return Python(path, version, {}, venv, platform)


def test_the_venv_is_made_with_the_controllers_minor_else_the_newest() -> None:
    same = Machine("m", "m", "/Users/me", pythons=(py("/usr/bin/python3", "3.9.6"),
                                                   py("/opt/homebrew/bin/python3.13", "3.13.1"),
                                                   py("/opt/homebrew/bin/python3.12", "3.12.8")))
    assert install._base_python(same, ENV).path == "/opt/homebrew/bin/python3.12"
    newest = Machine("m", "m", "/Users/me", pythons=(py("/usr/bin/python3", "3.9.6"), py("/a/python3.10", "3.10.4"),
                                                     py("/a/python3.11", "3.11.2"),
                                                     py("/v/python", "3.13.0", venv=True)))
    assert install._base_python(newest, ENV).path == "/a/python3.11"


def test_a_mac_with_only_macos_python_is_told_what_to_install() -> None:
    with pytest.raises(SetupError) as e:
        install._base_python(Machine("studio-1", "s", "/Users/me", pythons=(py("/usr/bin/python3", "3.9.6"),)), ENV)
    assert e.value.message == "studio-1: no Python 3.10 or newer (macOS's own python3 is 3.9)"
    assert e.value.hint == ("install Python 3.12 on studio-1 (python.org's installer, or Homebrew: brew install "
                            "python@3.12), then run install again")


@pytest.mark.parametrize(("platform", "version", "same"), [
    ("macosx-14.0-arm64", "3.12.1", True), ("macosx-15.0-arm64", "3.12.8", True),  # deployment targets may differ
    ("macosx-14.0-arm64", "3.11.9", False), ("macosx-14.0-x86_64", "3.12.1", False), ("linux-x86_64", "3.12.1", False),
])
def test_the_controllers_own_wheels_fit_the_same_os_architecture_and_python(
    platform: str, version: str, same: bool
) -> None:
    assert install._same_platform(py("/v/python", version, True, platform), ENV) is same


def test_controller_env_here_is_this_machines_versions() -> None:
    from importlib.metadata import version

    here = ControllerEnv.here()
    assert here.versions == {name: version(name) for name in ("mlx", "mlx-lm", "mlxpipe")}
    assert here.pins() == [f"{name}=={version(name)}" for name in ("mlx", "mlx-lm", "mlxpipe")]


RESULTS = [Installed("studio-1", INSTALLED, "", "/Users/a/.mlxpipe/venv/bin/python"),
           Installed("studio-2", UNCHANGED, "", "/Users/b/.mlxpipe/venv/bin/python"),
           Installed("studio-3", FAILED, "no python")]


def test_the_hostfile_names_the_venvs_afterwards(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    hosts = [{"ssh": "studio-1", "ips": ["10.0.0.1"], "python": "/usr/bin/python3"},
             {"ssh": "studio-2", "ips": ["10.0.0.2"]},
             {"ssh": "studio-3", "ips": ["10.0.0.3"], "python": "/x/python"},
             {"ssh": "studio-1", "ips": ["10.0.0.1"], "python": "/usr/bin/python3"}]  # a second rank there
    path.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": hosts}))
    assert install.point_hostfile(path, RESULTS) == ["studio-1", "studio-2"]
    pythons = [h.get("python") for h in json.loads(path.read_text())["hosts"]]
    assert pythons == ["/Users/a/.mlxpipe/venv/bin/python", "/Users/b/.mlxpipe/venv/bin/python", "/x/python",
                       "/Users/a/.mlxpipe/venv/bin/python"]
    before = path.stat().st_mtime_ns
    assert install.point_hostfile(path, RESULTS) == []  # nothing to change: the file is not rewritten
    assert path.stat().st_mtime_ns == before


def test_a_yaml_hostfile_stays_yaml(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("- ssh: studio-1\n  ips: [10.0.0.1]\n")
    assert install.point_hostfile(path, RESULTS) == ["studio-1"]
    assert yaml.safe_load(path.read_text()) == [{"ssh": "studio-1", "ips": ["10.0.0.1"],
                                                 "python": "/Users/a/.mlxpipe/venv/bin/python"}]


def test_a_local_host_is_left_to_the_controllers_environment() -> None:
    from mlxpipe.host import Host

    (result,) = install.install([Host(0, "127.0.0.1"), Host(1, "127.0.0.1")], env=ENV)
    assert result.status == install.SKIPPED and result.python is None
