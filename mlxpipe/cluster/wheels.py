"""Wheels of what this machine has installed: mlxpipe's own, and the packages its environment runs on.

``cluster install`` gives each host the controller's versions. Where a host cannot reach a package
registry, the wheels come from here: ``pack`` writes an installed distribution back into a wheel
(its files as installed, its own ``WHEEL`` tags, a fresh ``RECORD``), so nothing needs a network or a
build backend. mlxpipe installed editable (``pip install -e``) has no installed files to pack: ``own``
builds its wheel from the source tree with its build backend (``pip wheel``, as ``python -m build
--wheel`` does and as .ci/check-install proves), not a zip of whatever files the tree holds.
``closure`` is the set of distributions a requirement pulls in on this machine (markers evaluated here).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from mlxpipe.errors import SetupError

_SKIP_DIST_INFO = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def normalize(name: str) -> str:
    """PEP 503's name: ``mlx_lm`` and ``MLX-LM`` are ``mlx-lm``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``requirements`` need here, each once, dependencies included
    (extras followed, markers evaluated for this machine); ``SetupError`` when one is missing."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = normalize(req.name)
        try:
            dist = found.get(key) or metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SetupError(f"{req.name} is not installed on this machine, so it has no wheel of it to give",
                             "pass --wheelhouse with the hosts' wheels, or install it here") from None
        new = key not in found
        found[key] = dist
        for wanted in [""] * new + sorted(req.extras):
            for line in dist.requires or []:
                todo.append((Requirement(line), wanted))
    return sorted(found.values(), key=lambda d: normalize(d.metadata["Name"]))


def own(dist: metadata.Distribution, out_dir: Path) -> Path:
    """``dist``'s wheel in ``out_dir``: built from its source tree where the code runs from one (installed editable,
    or imported from a checkout), else packed from its installed files."""
    root = source_tree(dist)
    return pack(dist, out_dir) if root is None else build(root, dist.metadata["Name"], dist.version, out_dir)


def source_tree(dist: metadata.Distribution) -> Path | None:
    """The project directory (with a pyproject.toml) that ``dist``'s package is imported from, else None."""
    root = _editable_root(dist)
    if root is not None:
        return root
    try:
        spec = importlib.util.find_spec(normalize(dist.metadata["Name"]).replace("-", "_"))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def build(root: Path, name: str, version: str, out_dir: Path) -> Path:
    """The wheel of project ``name`` at ``root``, built by its own build backend (``pip wheel --no-deps``: PEP 517,
    with ``[build-system]``'s requirements: this environment's where it has them, as .ci/check-install builds, else
    an isolated environment's), into ``out_dir``; ``SetupError`` when the build fails or makes another version than
    ``version`` (the installed metadata, which the hosts are pinned to)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    isolation = ["--no-build-isolation"] if _backend_here(root) else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                           *isolation, "--wheel-dir", str(out_dir), str(root)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join([line.strip() for line in proc.stderr.splitlines() if line.strip()][-2:])
        raise SetupError(f"building a wheel of {root} failed: {tail or f'exit status {proc.returncode}'}",
                         "pip builds it with setuptools from the package registry: reach it, or pass --wheelhouse "
                         f"with the wheel (python -m build --wheel {root})")
    built = [p for p in out_dir.glob("*.whl") if normalize(p.name.split("-")[0]) == normalize(name)]
    found = [p for p in built if p.name.split("-")[1] == version]
    if not found:
        raise SetupError(f"{root} builds {', '.join(p.name for p in built) or 'no wheel'}, but the installed "
                         f"{name} says version {version}", f"reinstall it here (pip install -e {root}), then run "
                                                           "install again")
    return found[0]


def pack(dist: metadata.Distribution, out_dir: Path) -> Path:
    """Write ``dist`` as a wheel into ``out_dir`` (kept when one of that name is there) and return its path."""
    if source_tree(dist) is not None:
        raise SetupError(f"{dist.metadata['Name']} runs from its source tree: its wheel is built, not packed",
                         "this is a bug in mlxpipe: wheels.own builds it")
    name, version = dist.metadata["Name"], dist.version
    files = dict(_installed_files(dist))
    wheel_text = _wheel_text(dist)
    tag = _tag(wheel_text)
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    path = out_dir / f"{stem}-{tag}.whl"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    info = f"{stem}.dist-info"
    extra = {f"{info}/WHEEL": wheel_text.encode()}
    for rel in _dist_info_files(dist):
        if Path(rel).name not in _SKIP_DIST_INFO and Path(rel).name != "WHEEL":
            text = dist.read_text(Path(rel).name)
            if text is not None:
                extra[f"{info}/{Path(rel).name}"] = text.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    record = []
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as whl:
            for arcname, source in sorted(files.items()):
                data = source.read_bytes()
                whl.writestr(arcname, data)
                record.append((arcname, _hash(data), str(len(data))))
            for arcname, data in extra.items():
                whl.writestr(arcname, data)
                record.append((arcname, _hash(data), str(len(data))))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows([*record, (f"{info}/RECORD", "", "")])
            whl.writestr(f"{info}/RECORD", buf.getvalue())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _backend_here(root: Path) -> bool:
    """Whether this environment has every requirement of ``root``'s ``[build-system]`` (then the build needs no
    isolated environment, which takes pip seconds to make); False where that cannot be told."""
    from packaging.requirements import InvalidRequirement, Requirement

    if sys.version_info < (3, 11):
        return False  # no tomllib to read [build-system] with
    else:  # not a plain fall-through: mypy checks for 3.10, and would look for tomllib there
        import tomllib

        try:
            for line in tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"]:
                req = Requirement(line)
                if (req.marker is None or req.marker.evaluate()) and not req.specifier.contains(
                        metadata.version(req.name), prereleases=True):
                    return False
        except (OSError, KeyError, TypeError, ValueError, InvalidRequirement, metadata.PackageNotFoundError):
            return False
        return True


def _editable_root(dist: metadata.Distribution) -> Path | None:
    """The source tree of an editable install (``pip install -e``), else None."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    data = json.loads(text)
    if not data.get("dir_info", {}).get("editable") or not str(data.get("url", "")).startswith("file://"):
        return None
    return Path(data["url"][len("file://"):])


def _installed_files(dist: metadata.Distribution) -> Iterator[tuple[str, Path]]:
    """What an installed distribution put in site-packages (scripts outside it are remade by pip from its entry
    points)."""
    for f in dist.files or []:
        rel = str(f)
        if rel.startswith("..") or "__pycache__" in f.parts or rel.endswith(".pyc") or ".dist-info/" in rel:
            continue
        path = Path(str(f.locate()))
        if path.is_file():
            yield rel, path


def _dist_info_files(dist: metadata.Distribution) -> list[str]:
    base = getattr(dist, "_path", None)
    if base is not None and Path(base).is_dir():
        return sorted(p.name for p in Path(base).iterdir() if p.is_file())
    return ["METADATA", "entry_points.txt"]


def _wheel_text(dist: metadata.Distribution) -> str:
    text = dist.read_text("WHEEL")
    if text and "Tag:" in text:
        return text
    # Installed without a WHEEL file (an old setup.py install): a pure-Python wheel.
    return "Wheel-Version: 1.0\nGenerator: mlxpipe\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _tag(wheel_text: str) -> str:
    """The filename's tag from a WHEEL file's ``Tag:`` lines (several: each field's values joined by dots)."""
    tags = [line.split(":", 1)[1].strip() for line in wheel_text.splitlines() if line.startswith("Tag:")]
    fields = [list(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)]
    return "-".join(".".join(values) for values in fields)
