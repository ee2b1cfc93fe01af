"""What users install is what the code imports: every third-party import in mlxpipe/ is declared in pyproject.toml.

A package mlxpipe imports only because another dependency pulls it in (httpx through the test extra, numpy
through mlx-lm) works in the test venv and breaks a plain ``pip install mlxpipe`` the day that other package stops
pulling it: so each import, at the top of a module or inside a function, must name a distribution that
``[project] dependencies`` declares, or that the extra the module's own refusal names declares (``.ci/check-install``
proves the same on a fresh install).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mlxpipe"

# The modules that run only with an extra installed, and that extra: each is reached only after
# ``vision.prompt.require_vision`` has refused a text-only install in one line ("pip install 'mlxpipe[vision]'").
EXTRA_OF = {"mlxpipe/vision/": "vision", "mlxpipe/worker/vision.py": "vision"}


def _pyproject() -> dict[str, object]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]  # type: ignore[no-any-return]


def _names(requirements: list[str]) -> set[str]:
    """The normalized distribution names of ``requirements`` (PEP 508 strings)."""
    return {_normalize(re.split(r"[\s\[<>=!~;]", r.strip(), maxsplit=1)[0]) for r in requirements}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: Path) -> set[str]:
    """The top-level names ``path`` imports anywhere (module level, functions, ``TYPE_CHECKING`` blocks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _extra(rel: str) -> str | None:
    return next((extra for prefix, extra in EXTRA_OF.items() if rel.startswith(prefix)), None)


def third_party_imports() -> dict[str, dict[str, set[str]]]:
    """module path -> {top-level import name: the distributions installed here that provide it}, third-party
    imports only."""
    providers = metadata.packages_distributions()
    out: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for name in _imports(path):
            if name == "mlxpipe" or name in sys.stdlib_module_names or name == "__future__":
                continue
            out.setdefault(rel, {})[name] = {_normalize(d) for d in providers.get(name, [])}
    return out


def test_every_third_party_import_is_declared() -> None:
    project = _pyproject()
    base = _names(project["dependencies"])  # type: ignore[arg-type]
    extras = {name: _names(reqs) for name, reqs in project["optional-dependencies"].items()}  # type: ignore[attr-defined]
    undeclared = []
    for rel, imported in third_party_imports().items():
        extra = _extra(rel)
        allowed = base | (extras[extra] if extra else set())
        for name, dists in sorted(imported.items()):
            if not dists:
                undeclared.append(f"{rel}: imports {name}, which no installed distribution provides")
            elif not dists & allowed:
                where = f"dependencies or the {extra} extra" if extra else "dependencies"
                undeclared.append(f"{rel}: imports {name} (from {', '.join(sorted(dists))}), not in {where}")
    assert not undeclared, "\n".join(undeclared)


def test_an_extras_packages_are_imported_inside_functions() -> None:
    """Every module imports on a plain install (``.ci/check-install`` imports them all there): an extra's packages
    wait inside the functions that the extra's refusal guards, never at a module's top."""
    project = _pyproject()
    base = _names(project["dependencies"])  # type: ignore[arg-type]
    providers = metadata.packages_distributions()
    at_top = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            else:
                continue
            for name in names:
                dists = {_normalize(d) for d in providers.get(name, [])}
                if dists and not dists & base and name != "mlxpipe":
                    at_top.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not at_top, "\n".join(at_top)


def test_the_check_finds_an_undeclared_import(tmp_path: Path) -> None:
    """The scan reads imports inside functions too: a lazy import is still an import."""
    module = tmp_path / "m.py"
    module.write_text("import json\n\ndef f():\n    from rich.table import Table\n    import yaml.constructor\n")
    assert _imports(module) == {"json", "rich", "yaml"}
