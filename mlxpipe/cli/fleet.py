"""``--fleet``: ``plan`` and ``serve`` over a fleet file (``mlxpipe.fleet``) instead of one ``--model``.

The commands keep their one-model flags; with ``--fleet`` the per-model ones move into the file, each entry its
own, so giving one of them as well is refused (``refuse_model_flags``). Here: the option, that check, and
``plan --fleet`` (each entry's plan, and the hosts checked against everything they hold together).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from mlxpipe.cluster.hostfile import Hostfile as HostfileValue
    from mlxpipe.fleet.plan import FleetPlan
    from mlxpipe.fleet.spec import Fleet

FleetFile = Annotated[Path | None, typer.Option(
    "--fleet",
    help="A fleet file (YAML): several models, each on its own hosts of --hostfile, under its own names, behind "
    "one endpoint; each entry takes the per-model options (layout, tp, draft-model, adapter-path, the prompt "
    "cache's sizes...). See docs/serve.md.",
    show_default="none: the one --model",
)]


def refuse_model_flags(given: Mapping[str, object]) -> None:
    """With ``--fleet``, a per-model flag (``given``: each flag's value, None when not given) belongs in the file."""
    from mlxpipe.errors import UsageError

    for flag, value in given.items():
        if value not in (None, False, ()):
            key = flag.removeprefix("--")
            raise UsageError(f"{flag} is per model: with --fleet it goes in the fleet file, under each entry",
                             f"drop {flag}" + ("" if key in ("model", "config") else f" and give the entries '{key}'"))


def load(fleet: Path, hostfile: Path | None) -> Fleet:
    """The fleet file over ``--hostfile`` (the default hostfile when none is given)."""
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.cluster.target import default_hostfile
    from mlxpipe.fleet.spec import load_fleet

    cluster: HostfileValue = load_hostfile(hostfile) if hostfile else default_hostfile()
    return load_fleet(fleet, cluster)


def plan_fleet(fleet_path: Path, hostfile: Path | None, *, context: int, backend: str | None, workload: str | None,
               refresh: bool, json_out: bool) -> None:
    """``mlxpipe plan --fleet``: every entry's plan, then whether the hosts hold them together (exit 1 if not)."""
    from mlxpipe import console
    from mlxpipe.fleet.plan import entry_target
    from mlxpipe.fleet.plan import plan_fleet as plan_all
    from mlxpipe.plan.layout import workload as workload_named

    fleet = load(fleet_path, hostfile)
    chosen = workload_named(workload)
    metas = {}
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        from mlxpipe.cluster.target import load_model_metadata

        for entry in fleet.entries:
            with fleet.errors_of(entry):
                metas[entry.index] = load_model_metadata(entry_target(fleet, entry, 0, chosen), refresh=refresh,
                                                         progress=progress)
    the_plan = plan_all(fleet, metas, context=context, backend=backend, workload=chosen)
    if json_out:
        console.print_json(the_plan.to_json())
    else:
        _render(the_plan, fleet)
    _refuse_misfits(the_plan, context)


def _render(the_plan: FleetPlan, fleet: Fleet) -> None:
    from mlxpipe import console
    from mlxpipe.cli.render import plan_table

    for p in the_plan.placed:
        hosts = ", ".join(f"{i} ({fleet.hostfile.hosts[i].ssh})" for i in p.hosts)
        names = ", ".join(p.entry.model_names)
        console.out.print(f"[bold]{p.label}[/]: entry {p.entry.index}, replica {p.replica} of {p.entry.replicas}, "
                          f"on hosts {hosts}; answers to {names}", highlight=False)
        console.out.print(plan_table(p.plan))
        for note in p.plan.notes:
            console.out.print(f"[dim]note: {note}[/]")


def _refuse_misfits(the_plan: FleetPlan, context: int) -> None:
    """One line per host that cannot hold what it is given (alone, or with the other entries'), then exit 1."""
    from mlxpipe import console

    for p in the_plan.placed:
        for r in p.plan.ranks:
            if r.fits is False:
                console.error(f"{p.label}: rank {r.rank} ({r.host}) cannot hold its share at its context",
                              "see its plan above: give the entry more hosts, or a smaller model")
    for s in the_plan.shortfalls:
        console.error(f"host {s.host} ({s.ssh}) lacks {console.human_bytes(s.lacks_bytes)} to hold "
                      f"{' and '.join(s.holders)} together ({console.human_bytes(s.need_bytes)} of "
                      f"{console.human_bytes(s.budget_bytes)})", "move an entry to other hosts, or give it a "
                                                                 "shorter 'context'")
    if not the_plan.fits:
        raise typer.Exit(1)
