"""``mlxpipe doctor``: every host checked before a run; with --links, the links measured."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer

from mlxpipe import console
from mlxpipe.cli._options import (
    Backend,
    Config,
    Hostfile,
    Json,
    LayoutOption,
    Revision,
    Split,
    Strategy,
    Tp,
    WorkloadOption,
    parse_split,
    tcp_port,
)
from mlxpipe.defaults import DEFAULT_CONTEXT, DEFAULT_PORT


def doctor(
    hostfile: Hostfile = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Also check memory and disk for this model's plan, and whether its layout is "
        "predicted slower than fewer hosts would be (with the cluster's facts).",
        show_default="the --config preset's, else none: no memory or disk check",
    )] = None,
    revision: Revision = None,
    strategy: Strategy = None,
    split: Split = None,
    tp: Tp = None,
    layout: LayoutOption = None,
    workload: WorkloadOption = None,
    config: Config = None,
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
    from mlxpipe.cli._generation import settle_layout
    from mlxpipe.cli.render import doctor_table
    from mlxpipe.cluster.doctor import preflight
    from mlxpipe.cluster.hostfile import check_backend, load_hostfile
    from mlxpipe.cluster.layout_checks import layout_checks
    from mlxpipe.cluster.presets import pick
    from mlxpipe.cluster.target import default_hostfile, load_model_metadata, plan_target, resolve_target
    from mlxpipe.errors import UsageError
    from mlxpipe.plan.tensor import check_tp

    if calibrate and not links:
        raise UsageError("--calibrate goes with --links", "mlxpipe doctor --links --calibrate")
    the_plan = meta = target = None
    if all(v is None for v in (model, revision, strategy, split, config)):  # no model: no plan to check against
        hosts = load_hostfile(hostfile) if hostfile else default_hostfile()
        tp = check_tp(1 if tp is None else tp, hosts.size)
    else:
        target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp, layout, workload)
        hosts, backend = target.hostfile, pick(backend, target.preset.backend)
        with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
            meta = load_model_metadata(target, progress=progress)
        target = settle_layout(target, quiet=json_out, backend=backend, context=context, meta=meta).target
        the_plan = plan_target(target, meta, context=context, backend=backend)
        tp = target.tp
    check_backend(backend, "--backend")  # the flag's was checked while parsing; the preset's is checked here
    with console.err.status(f"checking {hosts.size} ranks...") if not json_out else contextlib.nullcontext():
        results = preflight(hosts, the_plan, meta, port=port, backend=backend, tp=tp)
    if target is not None and meta is not None and the_plan is not None:
        results += layout_checks(target, meta, the_plan, backend=backend)
    failed = [r for r in results if r.failed]
    facts = None
    if links and not failed:
        facts = _measure(hosts, backend, port, calibrate, json_out)
    if json_out:
        console.print_json({"ok": not failed, "checks": [r.to_json() for r in results],
                            **({"facts": facts.to_json()} if facts is not None else {})})
    else:
        console.out.print(doctor_table(results))
        if facts is not None:
            from mlxpipe.cli.render import facts_table
            from mlxpipe.cluster.facts_file import facts_path

            console.out.print(facts_table(facts, facts_path(hosts.path)))
    if failed:
        names = ", ".join(dict.fromkeys(r.host for r in failed))
        more = "; the links are measured once every check passes" if links else ""
        console.error(f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed on {names}{more}",
                      "apply the fixes in the fix column, then run `mlxpipe doctor` again")
        raise typer.Exit(1)


def _measure(hosts: Any, backend: str | None, port: int | None, calibrate: bool, quiet: bool) -> Any:
    """The links job (``launch/links_job.py``), its progress on stderr."""
    from mlxpipe.launch.links_job import measure

    def say(text: str) -> None:
        if not quiet:
            console.err.print(text, markup=False, highlight=False)

    return measure(hosts, calibrate=calibrate, backend=backend, port=port, on_progress=say)
