"""The suite's own layout: a test module imports fixtures (``tests/fixtures/``, ``conftest.py``), never another test
module, so each can be moved, split or run alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    """``tests.plan.test_shard``, ``test_shard`` or ``.test_shard``: a test module, by any of its names."""
    return any(part.startswith("test_") for part in name.split("."))


def _is_package(module: str) -> bool:
    """Whether ``module`` (``tests.plan``, ``fixtures``; empty: a relative import's own package) is a package of the
    suite, whose names may be modules (``from tests.plan import test_shard``), not a module whose names are not
    (``from fixtures.vision_models import test_image``)."""
    if not module:
        return True
    parts = module.split(".")
    root = TESTS.parent if parts[0] == "tests" else TESTS
    return root.joinpath(*parts).is_dir()


def imports_of_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a test module in ``source``, at any depth (function-level ones too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            # ``from . import test_x`` and ``from tests.plan import test_shard`` name the module among the names.
            names = [alias.name for alias in node.names] if _is_package(module) else []
            if _is_test_module(module) or any(_is_test_module(name) for name in names):
                found.append((node.lineno, "." * node.level + module))
    return found


def test_the_check_finds_every_way_of_importing_a_test_module() -> None:
    source = (
        "import tests.plan.test_shard\n"
        "from tests.plan.test_shard import meta\n"
        "from tests.plan import test_shard\n"
        "from .test_shard import meta\n"
        "import test_shard\n"
        "def f():\n"
        "    from tests.cli.test_plan import helper\n"
        "from fixtures.plan_inputs import meta\n"
        "from fixtures.vision_models import test_image\n"
        "from mlxpipe.plan.shard import make_plan\n"
    )
    assert [line for line, _ in imports_of_test_modules(source)] == [1, 2, 3, 4, 5, 7]


def test_no_test_module_imports_another() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}: imports {module}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for line, module in imports_of_test_modules(path.read_text())
    ]
    assert offenders == [], (
        "a test module imports another; move what they share to tests/fixtures/ (a fixture: register it in "
        "tests/conftest.py):\n" + "\n".join(offenders)
    )
