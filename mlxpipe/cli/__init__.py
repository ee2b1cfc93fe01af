"""The ``mlxpipe`` command line: thin commands over the core modules.

Each command checks its flags, builds typed configs, calls the core and renders the result; one
module per command, each option defined once in ``_options`` and the groups of them the commands
share (target, request, launch) in ``_groups``, the one error boundary in ``_errors``
(errors raised on purpose, ``MlxpipeError``, become one line plus a hint; exit codes: 0 success,
1 failure (a failed rank included), 2 usage error). Heavy imports wait inside the command bodies
and option callbacks: importing this package (``mlxpipe --help``, ``mlxpipe --version``) loads only
cli/ and the shared leaves (``defaults``, ``request``, ``errors``, ``console``), which
tests/cli/test_reference.py checks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Annotated, NoReturn

import typer

from mlxpipe import console
from mlxpipe.cli import cluster, demo_model, doctor, download, generate, lora, plan, serve
from mlxpipe.cli._errors import boundary, set_debug, stop_on_signals

# What `mlxpipe --version` reports: mlxpipe and the two packages that decide what a rank computes.
VERSIONED = ("mlxpipe", "mlx", "mlx-lm")

app = typer.Typer(
    name="mlxpipe",
    help=(
        "Run LLMs too large for one Mac across several Macs: as a pipeline (each host runs some of the "
        "layers), tensor-parallel (--tp: each host holds a slice of every layer), or both.\n\n"
        "`mlxpipe plan` shows which layers each host runs and whether it fits, `mlxpipe download` fetches "
        "each host's own weight files, and `mlxpipe doctor` checks every host before a run. "
        "`mlxpipe generate` and `mlxpipe chat` stream answers (--prompts-file: many prompts at once); "
        "`mlxpipe serve` keeps the model up behind OpenAI's, Anthropic's and Ollama's APIs, with a page "
        "showing the cluster in a browser; `mlxpipe lora` fine-tunes LoRA adapters across the hosts.\n\n"
        "Rank 0 runs the LAST layers. Exit codes: 0 success, 1 failure (any failed rank included), "
        "2 usage error, 130/143 interrupted."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def versions() -> dict[str, str | None]:
    """The installed version of each of ``VERSIONED``, None where it is missing (read from package
    metadata: importing mlx would cost seconds and could fail)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _show_versions(show: bool) -> None:
    """``--version``: one line per package, then exit 0 before any command runs."""
    if not show:
        return
    for name, installed in versions().items():
        console.out.print(f"{name} {installed or 'not installed'}", markup=False, highlight=False)
    raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")] = False,
    version: Annotated[bool, typer.Option(
        "--version", help="Show mlxpipe's, mlx's and mlx-lm's versions and exit.", callback=_show_versions,
        is_eager=True,
    )] = False,
) -> None:
    set_debug(debug)


# In this order in `mlxpipe --help` and docs/cli.md. The commands that launch ranks stop them on a signal.
app.command()(boundary(plan.plan))
app.command()(boundary(download.download))
app.command()(boundary(stop_on_signals(generate.generate)))
app.command()(boundary(stop_on_signals(generate.chat)))
app.command()(boundary(serve.serve))
app.command()(boundary(stop_on_signals(lora.lora)))
app.command("demo-model")(boundary(demo_model.demo_model))
app.command()(boundary(doctor.doctor))
app.add_typer(cluster.app)  # discover, init, install: the set-up of a cluster of Macs


def main() -> None:
    """The ``mlxpipe`` entry point. Once the command has finished, the process leaves as a rank does
    (``worker.__main__.leave``): output flushed, without Python's teardown of what the command loaded (mlx, mlx-lm,
    transformers: half a second of a core at the end of every command that launched ranks)."""
    try:
        app()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            raise  # a message for Python to print
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` now, when nothing is left running that Python's exit would wait for (a thread that is not
    a daemon, a child of multiprocessing): logging and standard output flushed first. Otherwise, Python's own exit."""
    running = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    children = "multiprocessing" in sys.modules and sys.modules["multiprocessing"].active_children()
    if running or children:
        sys.exit(code)
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away, a closed stream: Python's exit reports it
        sys.exit(code)
    os._exit(code)
