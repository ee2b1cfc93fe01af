"""``mlxpipe plan``: which layers each host runs, what it must hold and fetch, and whether it fits."""

from __future__ import annotations

from typing import Annotated

import typer

from mlxpipe import console
from mlxpipe.cli._options import Config, Hostfile, Json, Model, Revision, Split, Strategy, Tp, parse_split
from mlxpipe.defaults import DEFAULT_CONTEXT


def plan(
    model: Model = None,
    hostfile: Hostfile = None,
    revision: Revision = None,
    strategy: Strategy = None,
    split: Split = None,
    tp: Tp = None,
    config: Config = None,
    context: Annotated[int, typer.Option(
        "--context", help="Context length (tokens) the fit check reserves KV cache for."
    )] = DEFAULT_CONTEXT,
    refresh: Annotated[bool, typer.Option("--refresh", help="Re-read metadata from the hub even if cached.")] = False,
    json_out: Json = False,
) -> None:
    """Show which layers each host runs, what it must hold and fetch, and whether it fits.

    Reads only metadata (config, weight index, safetensors headers): no weights.

    Example: mlxpipe plan --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """  # noqa: E501 - the example is one command line, as the help prints it
    from mlxpipe.cli.render import plan_table
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp)
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, refresh=refresh, progress=progress)
    the_plan = plan_target(target, meta, context=context)
    if json_out:
        console.print_json(the_plan.to_json())
    else:
        console.out.print(plan_table(the_plan))
        for note in the_plan.notes:
            console.out.print(f"[dim]note: {note}[/]")
    if not the_plan.fits:
        bad = ", ".join(f"rank {r.rank} ({r.host})" for r in the_plan.ranks if r.fits is False)
        hint = (
            f"this split fits: --split {','.join(map(str, the_plan.suggested_split))}"
            if the_plan.suggested_split
            else "no split fits these hosts: add hosts or memory, or use a smaller (more quantized) model"
        )
        console.error(f"{bad} cannot hold its share at --context {context}", hint)
        raise typer.Exit(1)



