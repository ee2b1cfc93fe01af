"""``mlxpipe plan``: which layers each host runs, what it must hold and fetch, and whether it fits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxpipe import console
from mlxpipe.cli._groups import TargetFlags, option_groups
from mlxpipe.cli._options import Backend, FleetFile, Json
from mlxpipe.defaults import DEFAULT_CONTEXT

if TYPE_CHECKING:
    from mlxpipe.cluster.target import Settled
    from mlxpipe.plan.shard import Plan


@option_groups
def plan(
    flags: TargetFlags,
    backend: Backend = None,
    context: Annotated[int, typer.Option(
        "--context", help="Context length (tokens) the fit check reserves KV cache for."
    )] = DEFAULT_CONTEXT,
    refresh: Annotated[bool, typer.Option("--refresh", help="Re-read metadata from the hub even if cached.")] = False,
    json_out: Json = False,
    fleet: FleetFile = None,
) -> None:
    """Show which layers each host runs, what it must hold and fetch, and whether it fits.

    Reads only metadata (config, weight index, safetensors headers): no weights. With the cluster's
    measured facts beside the hostfile (`mlxpipe doctor --links`), every feasible layout is shown with
    its predicted decode, prefill and aggregate tok/s, and --layout auto (the default) plans the one
    predicted fastest for --workload.

    Example: mlxpipe plan --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """  # noqa: E501 - the example is one command line, as the help prints it
    from mlxpipe.cli._generation import settle_layout
    from mlxpipe.cluster.target import load_model_metadata, plan_target

    if fleet is not None:  # every entry of the file, each on its own hosts of --hostfile
        from mlxpipe.cli.fleet import plan_fleet

        plan_fleet(fleet, flags, context=context, backend=backend, refresh=refresh, json_out=json_out)
        return
    target = flags.target()
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, refresh=refresh, progress=progress)
    settled = settle_layout(target, quiet=json_out, backend=backend, context=context, meta=meta, say=False)
    the_plan = plan_target(settled.target, meta, context=context, backend=backend)
    if json_out:
        console.print_json(_plan_json(the_plan, settled, target.layout_asked))
    else:
        _print_plan(the_plan, settled, target.layout_asked)
    if not the_plan.fits:
        bad = ", ".join(f"rank {r.rank} ({r.host})" for r in the_plan.ranks if r.fits is False)
        hint = (
            f"this split fits: --split {','.join(map(str, the_plan.suggested_split))}"
            if the_plan.suggested_split
            else "no split fits these hosts: add hosts or memory, or use a smaller (more quantized) model"
        )
        console.error(f"{bad} cannot hold its share at --context {context}", hint)
        raise typer.Exit(1)


def _plan_json(the_plan: Plan, settled: Settled, asked: bool) -> dict[str, Any]:
    """The plan's JSON, with the layouts weighed (and, ``asked`` for --layout, why none were)."""
    data = the_plan.to_json()
    choice = settled.choice
    if choice is not None:
        found = bool(choice.candidates)
        data["layouts"] = {"workload": choice.workload.name, "chosen": choice.chosen.name if found else None,
                           "reason": choice.reason if found else None,
                           "candidates": [c.estimate.to_json() for c in choice.candidates],
                           "refused": [{"layout": name, "why": why} for name, why in choice.refused]}
    if settled.note and asked:  # asked for: say why no layout was weighed
        data["layout_note"] = settled.note
    return data


def _print_plan(the_plan: Plan, settled: Settled, asked: bool) -> None:
    """The layouts weighed and the choice (or, ``asked`` for --layout, why none were), then the plan's table."""
    from mlxpipe.cli.render import layouts_table, plan_table

    choice = settled.choice
    if choice is not None and choice.candidates:
        console.out.print(layouts_table(choice))
        console.out.print(f"layout: {choice.reason}", markup=False, highlight=False, soft_wrap=True)
    elif settled.note and asked:
        console.out.print(f"[dim]{settled.note}[/]", highlight=False)
    console.out.print(plan_table(the_plan))
    for note in the_plan.notes:
        console.out.print(f"[dim]note: {note}[/]")
