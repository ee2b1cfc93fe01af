"""Wheels packed from this machine's installed packages: what install sends hosts without a registry."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from mlxpipe.cluster import wheels
from mlxpipe.errors import SetupError


def test_closure_follows_requirements_extras_and_markers() -> None:
    names = {wheels.normalize(d.metadata["Name"]) for d in wheels.closure(["mlxpipe"])}
    assert {"mlxpipe", "mlx", "mlx-lm", "transformers", "zeroconf", "ifaddr", "typer"} <= names
    if sys.platform != "darwin":
        assert "mlx-cpu" in names  # mlx[cpu] off macOS: the extra is followed
    assert not names & {"pytest", "openai", "selenium"}  # the test extra is not asked for


def test_closure_names_a_missing_package() -> None:
    with pytest.raises(SetupError) as e:
        wheels.closure(["no-such-package-here"])
    assert e.value.message.startswith("no-such-package-here is not installed on this machine")


def test_mlxpipe_from_its_source_tree_is_built_there(tmp_path: Path) -> None:
    """The wheel the hosts get is the one the build backend makes (what .ci/check-install proves), not a zip of
    the tree: its files are setuptools' choice, its RECORD true, and it installs with its entry point."""
    dist = metadata.distribution("mlxpipe")
    path = wheels.own(dist, tmp_path / "w")
    assert path.name == f"mlxpipe-{metadata.version('mlxpipe')}-py3-none-any.whl"
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        record_path = f"mlxpipe-{metadata.version('mlxpipe')}.dist-info/RECORD"
        record = list(csv.reader(io.StringIO(whl.read(record_path).decode())))
        for name, digest, size in record:
            if digest:  # every file's hash and size as RECORD says
                data = whl.read(name)
                encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == "sha256=" + encoded
                assert int(size) == len(data)
    package = Path(wheels.__file__).parents[1]
    sources = {str(p.relative_to(package.parent)) for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    assert sources <= names and "mlxpipe/serve/page/index.html" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(target), str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (target / "mlxpipe" / "cluster" / "wheels.py").read_text() == Path(wheels.__file__).read_text()
    assert metadata.Distribution.at(next(target.glob("mlxpipe-*.dist-info"))).entry_points.select(name="mlxpipe")
    with pytest.raises(SetupError) as e:
        wheels.pack(dist, tmp_path / "packed")
    assert e.value.message == "mlxpipe runs from its source tree: its wheel is built, not packed"


_BACKEND = """
import zipfile


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if {fail}:
        raise RuntimeError("the backend refused")
    name = "demo_pkg-1.0-py3-none-any.whl"
    info = "demo_pkg-1.0.dist-info"
    with zipfile.ZipFile(wheel_directory + "/" + name, "w") as whl:
        whl.writestr(info + "/METADATA", "Metadata-Version: 2.1\\nName: demo-pkg\\nVersion: 1.0\\n")
        whl.writestr(info + "/WHEEL",
                     "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n")
        whl.writestr(info + "/RECORD", "")
    return name
"""


def _project(root: Path, fail: bool = False) -> Path:
    """A project whose in-tree build backend makes demo-pkg 1.0 (no build requirements: nothing to download)."""
    root.mkdir()
    (root / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                         'backend-path = ["."]\n')
    (root / "backend.py").write_text(_BACKEND.format(fail=fail))
    return root


def test_a_build_is_the_installed_version_or_refused(tmp_path: Path) -> None:
    root = _project(tmp_path / "demo")
    assert wheels.build(root, "demo-pkg", "1.0", tmp_path / "a").name == "demo_pkg-1.0-py3-none-any.whl"
    with pytest.raises(SetupError) as e:
        wheels.build(root, "demo_pkg", "2.0", tmp_path / "b")
    assert e.value.message == (f"{root} builds demo_pkg-1.0-py3-none-any.whl, but the installed demo_pkg says "
                               "version 2.0")
    assert e.value.hint == f"reinstall it here (pip install -e {root}), then run install again"


def test_a_failed_build_names_the_tree_and_the_way_around(tmp_path: Path) -> None:
    root = _project(tmp_path / "broken", fail=True)
    with pytest.raises(SetupError) as e:
        wheels.build(root, "demo-pkg", "1.0", tmp_path / "out")
    assert e.value.message.startswith(f"building a wheel of {root} failed: ")
    assert e.value.hint.endswith(f"pass --wheelhouse with the wheel (python -m build --wheel {root})")


def test_an_installed_binary_package_keeps_its_platform_tag(tmp_path: Path) -> None:
    dist = metadata.distribution("PyYAML")
    path = wheels.pack(dist, tmp_path)
    wheel = (dist.read_text("WHEEL") or "").splitlines()
    tags = [line.split(":", 1)[1].strip() for line in wheel if line.startswith("Tag:")]
    assert path.name.startswith(f"PyYAML-{dist.version}-") and tags
    assert all(tag.split("-")[2] in path.name for tag in tags)
    assert wheels.pack(dist, tmp_path) == path  # already there: kept


def test_tags_of_several_lines_join_per_field() -> None:
    text = "Tag: cp311-cp311-manylinux_2_17_x86_64\nTag: cp311-cp311-manylinux2014_x86_64\n"
    assert wheels._tag(text) == "cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no tomllib: every build is isolated there")
@pytest.mark.parametrize(("requires", "here"), [
    ('["setuptools>=1"]', True),  # this environment has it: built without an isolated environment
    ('["setuptools>=999"]', False),
    ('["no-such-backend-xyz"]', False),
    ('["setuptools>=999; python_version < \'3\'"]', True),  # a marker that leaves it out
    (None, False),  # no [build-system] to read
])
def test_the_build_backend_is_this_environments_where_it_has_what_the_project_asks(
        tmp_path: Path, requires: str | None, here: bool) -> None:
    (tmp_path / "pyproject.toml").write_text(f"[build-system]\nrequires = {requires}\n" if requires else "[project]\n")
    assert wheels._backend_here(tmp_path) is here
