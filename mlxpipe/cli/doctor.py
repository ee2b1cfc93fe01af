"""``mlxpipe doctor``: every host checked before a run; with --links, the links measured."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxpipe import console
from mlxpipe.cli._groups import Take, TargetFlags, option_groups
from mlxpipe.cli._options import Backend, Json, tcp_port
from mlxpipe.defaults import DEFAULT_CONTEXT, DEFAULT_PORT

if TYPE_CHECKING:
    from mlxpipe.cluster.check_result import CheckResult
    from mlxpipe.cluster.hostfile import Hostfile
    from mlxpipe.cluster.target import Target
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.plan.shard import Plan

DoctorModel = Annotated[str | None, typer.Option(
    "--model", "-m", help="Also check memory and disk for this model's plan, and whether its layout is "
    "predicted slower than fewer hosts would be (with the cluster's facts).",
    show_default="the --config preset's, else none: no memory or disk check",
)]


@option_groups
def doctor(
    flags: Annotated[TargetFlags, Take(model=DoctorModel)],
    port: Annotated[int | None, typer.Option(
        "--port", help="First ring port to check.",
        show_default=f"{DEFAULT_PORT}; unchecked when every rank is local", callback=tcp_port,
    )] = None,
    backend: Backend = None,
    context: Annotated[int, typer.Option(
        "--context", help="Context length (tokens) the memory check reserves KV cache for."
    )] = DEFAULT_CONTEXT,
    links: Annotated[bool, typer.Option(
        "--links", help="Once every check passes, measure the links by a real MLX job over the hostfile's backend "
        "(each neighbour pair's latency and bandwidth, each machine's memory bandwidth and matrix throughput) and "
        "write them beside the hostfile (cluster.json -> cluster.facts.json), where plan and --layout auto read them.",
    )] = False,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="With --links: also time real transformer layers on each machine (about a minute), so the "
        "cost model uses what they reach instead of published figures at assumed efficiencies.",
    )] = False,
    json_out: Json = False,
) -> None:
    """Check every host before a run: ssh, versions, ring ports; with --model, memory and disk; with --tp, links.

    With --tp, a group whose links are TCP gets a warning: tensor parallelism wants RDMA. With --model
    and the cluster's facts, a layout predicted slower than the hostfile's first hosts alone gets a
    warning with both figures. Each failed check comes with its fix. Exit status 1 if any check fails.

    Example: mlxpipe doctor --hostfile hostfiles/mac-studio-2-thunderbolt.json --model mlx-community/Llama-3.3-70B-Instruct-4bit

    Example: mlxpipe doctor --links --hostfile cluster.json
    """  # noqa: E501 - the examples are one command line each, as the help prints them
    from mlxpipe.cluster.doctor import preflight
    from mlxpipe.cluster.hostfile import check_backend
    from mlxpipe.cluster.layout_checks import layout_checks
    from mlxpipe.errors import UsageError

    if calibrate and not links:
        raise UsageError("--calibrate goes with --links", "mlxpipe doctor --links --calibrate")
    if flags.names_a_model:
        planned = _plan(flags, backend, context, json_out)
        hosts, backend, tp = planned.target.hostfile, planned.backend, planned.target.tp
    else:  # no model: no plan to check against, the hosts alone (--tp checked against them)
        planned, hosts, tp = None, flags.hosts(), flags.tp or 1
    check_backend(backend, "--backend")  # the flag's was checked while parsing; the preset's is checked here
    with console.err.status(f"checking {hosts.size} ranks...") if not json_out else contextlib.nullcontext():
        results = preflight(hosts, planned.plan if planned else None, planned.meta if planned else None, port=port,
                            backend=backend, tp=tp)
    if planned:
        results += layout_checks(planned.target, planned.meta, planned.plan, backend=backend)
    failed = [r for r in results if r.failed]
    facts = _measure(hosts, backend, port, calibrate, json_out) if links and not failed else None
    _report(results, facts, hosts, json_out)
    if failed:
        names = ", ".join(dict.fromkeys(r.host for r in failed))
        more = "; the links are measured once every check passes" if links else ""
        console.error(f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed on {names}{more}",
                      "apply the fixes in the fix column, then run `mlxpipe doctor` again")
        raise typer.Exit(1)


@dataclass(frozen=True)
class _Planned:
    """The model's plan the checks compare the hosts against, and the backend chosen for it."""

    target: Target
    meta: ModelMetadata
    plan: Plan
    backend: str | None


def _plan(flags: TargetFlags, backend: str | None, context: int, quiet: bool) -> _Planned:
    """The target's plan at ``context``, in the layout that would run."""
    from mlxpipe.cli._generation import settle_layout
    from mlxpipe.cluster.presets import pick
    from mlxpipe.cluster.target import load_model_metadata, plan_target

    target = flags.target()
    backend = pick(backend, target.preset.backend)
    with console.ProgressCallback("reading safetensors headers", enabled=not quiet) as progress:
        meta = load_model_metadata(target, progress=progress)
    target = settle_layout(target, quiet=quiet, backend=backend, context=context, meta=meta).target
    return _Planned(target, meta, plan_target(target, meta, context=context, backend=backend), backend)


def _report(results: list[CheckResult], facts: Any, hosts: Hostfile, json_out: bool) -> None:
    """Every check, and the links measured (with --links)."""
    if json_out:
        console.print_json({"ok": not any(r.failed for r in results), "checks": [r.to_json() for r in results],
                            **({"facts": facts.to_json()} if facts is not None else {})})
        return
    from mlxpipe.cli.render import doctor_table

    console.out.print(doctor_table(results))
    if facts is not None:
        from mlxpipe.cli.render import facts_table
        from mlxpipe.cluster.facts_file import facts_path

        console.out.print(facts_table(facts, facts_path(hosts.path)))


def _measure(hosts: Any, backend: str | None, port: int | None, calibrate: bool, quiet: bool) -> Any:
    """The links job (``launch/links_job.py``), its progress on stderr."""
    from mlxpipe.launch.links_job import measure

    def say(text: str) -> None:
        if not quiet:
            console.err.print(text, markup=False, highlight=False)

    return measure(hosts, calibrate=calibrate, backend=backend, port=port, on_progress=say)
