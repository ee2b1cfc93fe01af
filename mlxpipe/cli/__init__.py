"""The ``mlxpipe`` command line: thin commands over the core modules.

Each command checks its flags, builds plain values, calls the core and renders the result; one
module per command, the options they share in ``_options``, the one error boundary in ``_errors``
(errors raised on purpose, ``MlxpipeError``, become one line plus a hint; exit codes: 0 success,
1 failure (a failed rank included), 2 usage error). Heavy imports wait inside the command bodies,
so that ``mlxpipe --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from mlxpipe.cli import demo, doctor, download, generate, lora, plan, serve
from mlxpipe.cli._errors import boundary, set_debug, stop_on_signals

app = typer.Typer(
    name="mlxpipe",
    help=(
        "Run LLMs too large for one Mac as a pipeline across several.\n\n"
        "Start with `mlxpipe plan`, then `mlxpipe download`, then `mlxpipe generate` or `mlxpipe chat`, "
        "or keep the model up behind an OpenAI-compatible API with `mlxpipe serve`; "
        "`mlxpipe doctor` checks every host first.\n\n"
        "Rank 0 runs the LAST layers. Exit codes: 0 success, 1 failure (any failed rank included), "
        "2 usage error, 130/143 interrupted."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")] = False,
) -> None:
    set_debug(debug)


# In this order in `mlxpipe --help` and docs/cli.md. The commands that launch ranks stop them on a signal.
app.command()(boundary(plan.plan))
app.command()(boundary(download.download))
app.command()(boundary(stop_on_signals(generate.generate)))
app.command()(boundary(stop_on_signals(generate.chat)))
app.command()(boundary(serve.serve))
app.command()(boundary(stop_on_signals(lora.lora)))
app.command("demo-model")(boundary(demo.demo_model))
app.command()(boundary(doctor.doctor))


def main() -> None:
    """The ``mlxpipe`` entry point."""
    app()
