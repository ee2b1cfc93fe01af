"""The command-line reference, ``docs/cli.md``, generated from the app itself.

    python -m mlxpipe.cli.reference > docs/cli.md      (or: make docs)

Each command's ``--help`` exactly as a user sees it, at a fixed width and without
colour. ``tests/cli/test_reference.py`` fails when the checked-in file differs from
what the app prints now, so the reference cannot drift from the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

WIDTH = 100
PROG = "mlxpipe"
REGENERATE = "python -m mlxpipe.cli.reference > docs/cli.md"
_PAGES_FLAG = "--pages-json"
# Environment variables that make typer or Rich draw for a terminal (colour, styles, another width).
_TERMINAL_ENV = (
    "TERMINAL_WIDTH", "COLUMNS", "LINES", "FORCE_COLOR", "PY_COLORS", "CLICOLOR_FORCE", "GITHUB_ACTIONS",
    "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES",
)


def commands() -> list[list[str]]:
    """The argument lists whose help the reference shows: the app, then each command in the app's order
    (a group such as ``cluster``, then each of its commands)."""
    from typer.main import get_command

    from mlxpipe.cli import app

    root = get_command(app)
    found: list[list[str]] = [[]]

    def walk(group: Any, path: list[str]) -> None:
        ctx = group.make_context(" ".join([PROG, *path]), [], resilient_parsing=True)
        for name in group.list_commands(ctx):
            found.append([*path, name])
            sub = group.get_command(ctx, name)
            if hasattr(sub, "list_commands"):
                walk(sub, [*path, name])

    walk(root, [])
    return found


def help_pages(width: int = WIDTH) -> dict[str, str]:
    """``{"mlxpipe": ..., "mlxpipe plan": ..., ...}``: each help page as printed at ``width`` columns, no colour.

    Rendered in a fresh interpreter: typer reads the terminal's width and colour from the
    environment once, when it is imported, so this process's own settings must not leak in.
    """
    env = {k: v for k, v in os.environ.items() if k not in _TERMINAL_ENV}
    env.update(TERMINAL_WIDTH=str(width), COLUMNS=str(width), NO_COLOR="1", TERM="dumb")
    # The child must import this very mlxpipe, not another one installed elsewhere.
    source = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "mlxpipe.cli.reference", _PAGES_FLAG],
        env=env, capture_output=True, text=True, check=False, timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rendering the help pages failed:\n{done.stderr}")
    pages: dict[str, str] = json.loads(done.stdout)
    return pages


def _pages_here() -> dict[str, str]:
    """The help pages rendered in this process, which ``help_pages`` started with a plain environment."""
    from typer.testing import CliRunner

    from mlxpipe.cli import app

    pages = {}
    for args in commands():
        result = CliRunner().invoke(app, [*args, "--help"], prog_name=PROG)
        if result.exit_code != 0:
            raise RuntimeError(f"{PROG} {' '.join(args)} --help exited {result.exit_code}: {result.output}")
        pages[" ".join([PROG, *args])] = _tidy(result.stdout)
    return pages


def _tidy(page: str) -> str:
    """Rich pads every line to the full width: drop trailing spaces and the blank lines around the page."""
    return "\n".join(line.rstrip() for line in page.splitlines()).strip("\n") + "\n"


def _anchor(title: str) -> str:
    """The heading's anchor as GitHub makes it ("mlxpipe demo-model" -> "mlxpipe-demo-model")."""
    return title.lower().replace(" ", "-")


def reference(width: int = WIDTH) -> str:
    """The whole of ``docs/cli.md``."""
    pages = help_pages(width)
    lines = [
        "# Command-line reference",
        "",
        f"<!-- Generated from the app by `{REGENERATE}`; do not edit by hand.",
        "     tests/cli/test_reference.py fails when this file differs from what the app prints. -->",
        "",
        f"Every `{PROG}` command's `--help`, as printed at a width of {width} columns. Where a default",
        "is written in parentheses, it is described rather than a literal value: the option's real default",
        "is unset, and the command decides (often from the `--config` preset).",
        "",
        *[f"- [`{title}`](#{_anchor(title)})" for title in pages],
    ]
    for title, page in pages.items():
        lines += ["", f"## {title}", "", "```text", page.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == [_PAGES_FLAG]:
        sys.stdout.write(json.dumps(_pages_here()))
    elif not args:
        sys.stdout.write(reference())
    else:
        sys.exit(f"usage: {REGENERATE}")


if __name__ == "__main__":
    main()
