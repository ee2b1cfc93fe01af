"""``mlxpipe doctor``: every host checked before a run."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from mlxpipe import console
from mlxpipe.cli._options import Backend, Config, Hostfile, Json, Revision, Split, Strategy, Tp, parse_split, tcp_port
from mlxpipe.defaults import DEFAULT_CONTEXT, DEFAULT_PORT


def doctor(
    hostfile: Hostfile = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Also check memory and disk for this model's plan.",
        show_default="the --config preset's, else none: no memory or disk check",
    )] = None,
    revision: Revision = None,
    strategy: Strategy = None,
    split: Split = None,
    tp: Tp = None,
    config: Config = None,
    port: Annotated[int | None, typer.Option(
        "--port", help="First ring port to check.",
        show_default=f"{DEFAULT_PORT}; unchecked when every rank is local", callback=tcp_port,
    )] = None,
    backend: Backend = None,
    context: Annotated[int, typer.Option(
        "--context", help="Context length (tokens) the memory check reserves KV cache for."
    )] = DEFAULT_CONTEXT,
    json_out: Json = False,
) -> None:
    """Check every host before a run: ssh, versions, ring ports; with --model, memory and disk; with --tp, links.

    With --tp, a group whose links are TCP gets a warning: tensor parallelism wants RDMA. Each failed
    check comes with its fix. Exit status 1 if any check fails.

    Example: mlxpipe doctor --hostfile hostfiles/mac-studio-2-thunderbolt.json --model mlx-community/Llama-3.3-70B-Instruct-4bit
    """  # noqa: E501 - the example is one command line, as the help prints it
    from mlxpipe.cli.render import doctor_table
    from mlxpipe.cluster.doctor import preflight
    from mlxpipe.cluster.hostfile import check_backend, load_hostfile
    from mlxpipe.cluster.presets import pick
    from mlxpipe.cluster.target import default_hostfile, load_model_metadata, plan_target, resolve_target
    from mlxpipe.plan.tensor import check_tp

    the_plan = meta = None
    if all(v is None for v in (model, revision, strategy, split, config)):  # no model: no plan to check against
        hosts = load_hostfile(hostfile) if hostfile else default_hostfile()
        tp = check_tp(1 if tp is None else tp, hosts.size)
    else:
        target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp)
        hosts, backend = target.hostfile, pick(backend, target.preset.backend)
        with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
            meta = load_model_metadata(target, progress=progress)
        the_plan = plan_target(target, meta, context=context)
        tp = target.tp
    check_backend(backend, "--backend")  # the flag's was checked while parsing; the preset's is checked here
    with console.err.status(f"checking {hosts.size} ranks...") if not json_out else contextlib.nullcontext():
        results = preflight(hosts, the_plan, meta, port=port, backend=backend, tp=tp)
    failed = [r for r in results if r.failed]
    if json_out:
        console.print_json({"ok": not failed, "checks": [r.to_json() for r in results]})
    else:
        console.out.print(doctor_table(results))
    if failed:
        names = ", ".join(dict.fromkeys(r.host for r in failed))
        console.error(f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed on {names}",
                      "apply the fixes in the fix column, then run `mlxpipe doctor` again")
        raise typer.Exit(1)



