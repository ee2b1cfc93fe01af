"""``--fleet``: ``plan`` and ``serve`` over a fleet file (``mlxpipe.fleet``) instead of one ``--model``.

``--fleet`` is one more option of both commands (``_options.FleetFile``); they keep their option groups. With it
the per-model options of those groups move into the file, each entry its own, so giving one of them as well is
refused (``refuse_model_flags``); the others are shared by every entry, or are the entries' defaults where an entry
may give its own (``context``, ``num-draft-tokens``, the prompt cache's sizes). Here: that check, ``plan --fleet``
(each entry's plan, and the hosts checked against everything they hold together) and ``serve --fleet`` (each
entry's pipelines made of the file and the groups, behind one endpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

if TYPE_CHECKING:
    from mlxpipe.cli._groups import LaunchFlags, RequestFlags, TargetFlags
    from mlxpipe.cli.serve import ServeFlags
    from mlxpipe.cluster.hostfile import Hostfile as HostfileValue
    from mlxpipe.fleet.plan import FleetPlan
    from mlxpipe.fleet.spec import Fleet, FleetEntry
    from mlxpipe.plan.parallel_layout import Workload
    from mlxpipe.serve.fleet_server import FleetPipeline

T = TypeVar("T")

# The groups' per-model options, by field: each the entry's key that gives it with --fleet (None: none does;
# --model and --config are the fleet file itself, --split an entry's 'strategy').
_PER_MODEL = {"model": None, "revision": "revision", "strategy": "strategy", "split": None, "tp": "tp",
              "layout": "layout", "config": None, "served_model_name": "names", "draft_model": "draft-model",
              "adapter_path": "adapter-path"}


def refuse_model_flags(*groups: TargetFlags | ServeFlags | LaunchFlags) -> None:
    """With ``--fleet``, a per-model option given in one of ``groups`` (``TargetFlags``, ``ServeFlags``,
    ``LaunchFlags``: the flags as given, None when not) belongs in the file."""
    from mlxpipe.errors import UsageError

    for group in groups:
        given = {f.name: getattr(group, f.name) for f in fields(group)}
        for field, key in _PER_MODEL.items():
            value = given.get(field)
            if value not in (None, False, (), []):
                flag = "--" + field.replace("_", "-")
                raise UsageError(f"{flag} is per model: with --fleet it goes in the fleet file, under each entry",
                                 f"drop {flag}" + ("" if key is None else f" and give the entries '{key}'"))


def load(fleet: Path, hostfile: Path | None) -> Fleet:
    """The fleet file over ``--hostfile`` (the default hostfile when none is given)."""
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.cluster.target import default_hostfile
    from mlxpipe.fleet.spec import load_fleet

    cluster: HostfileValue = load_hostfile(hostfile) if hostfile else default_hostfile()
    return load_fleet(fleet, cluster)


def plan_fleet(fleet_path: Path, flags: TargetFlags, *, context: int, backend: str | None, refresh: bool,
               json_out: bool) -> None:
    """``mlxpipe plan --fleet``: every entry's plan, then whether the hosts hold them together (exit 1 if not).
    Of ``flags``, only ``--hostfile`` and ``--workload`` are the fleet's; the others are refused."""
    from mlxpipe import console
    from mlxpipe.cluster.target import load_model_metadata
    from mlxpipe.fleet.plan import entry_target
    from mlxpipe.fleet.plan import plan_fleet as plan_all
    from mlxpipe.plan.parallel_layout import workload as workload_named

    refuse_model_flags(flags)
    chosen = workload_named(flags.workload)
    fleet = load(fleet_path, flags.hostfile)
    metas = {}
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
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


def serve_fleet(fleet_path: Path, *, target: TargetFlags, server: ServeFlags, request: RequestFlags,
                launch: LaunchFlags) -> int:
    """``mlxpipe serve --fleet``: every entry's pipelines behind one endpoint; the exit status. The groups are
    ``serve``'s, as given: their per-model options are refused, the others shared by every pipeline."""
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.fleet.ports import first_ports
    from mlxpipe.plan.parallel_layout import workload as workload_named
    from mlxpipe.serve.fleet_server import Endpoint
    from mlxpipe.serve.fleet_server import serve_fleet as serve_all

    refuse_model_flags(target, server, launch)
    defaults = request.request(Preset())
    limits = server.limits()
    server.check()
    chosen = workload_named(target.workload)
    fleet = load(fleet_path, target.hostfile)
    places = [(entry, replica) for entry in fleet.entries for replica in range(entry.replicas)]
    hostfiles = [fleet.replica_hostfile(e, r) for e, r in places]
    ports = first_ports(hostfiles, ring_base(hostfiles, launch.ring_port))
    pipelines = [_pipeline(fleet, entry, replica, chosen, server=server, launch=replace(launch, ring_port=port),
                           max_kv_size=request.max_kv_size)
                 for (entry, replica), port in zip(places, ports, strict=True)]
    endpoint = Endpoint(host=server.host, port=server.port, api_key=server.api_key, defaults=defaults,
                        max_body_bytes=server.max_body_size, any_model_name=server.any_model_name,
                        image_limits=limits,
                        image_url_timeout=server.image_url_timeout if server.allow_image_urls else None)
    return serve_all(pipelines, fleet.hostfile, endpoint)


def ring_base(pipelines: Sequence[HostfileValue], ring_port: int | None) -> int:
    """Where the pipelines' ring ports start: ``--ring-port``, else a free port with room for every pipeline's when
    every rank is local (as ``launch.command.default_port`` does for one pipeline), else mlx.launch's port."""
    from mlxpipe.defaults import DEFAULT_PORT
    from mlxpipe.fleet.ports import all_local, ports_needed
    from mlxpipe.launch.command import free_port_base

    if ring_port is not None:
        return ring_port
    if all_local(pipelines):
        return free_port_base(sum(ports_needed(h) for h in pipelines))
    return DEFAULT_PORT


def _pipeline(fleet: Fleet, entry: FleetEntry, replica: int, workload: Workload, *, server: ServeFlags,
              launch: LaunchFlags, max_kv_size: int | None) -> FleetPipeline:
    """One replica's launch config and queue options: the entry's options, else the flags'; checked as a single
    serve checks them, each error naming the fleet file and the entry."""
    from mlxpipe.cli._generation import check_draft_flags, settle_config
    from mlxpipe.fleet.plan import entry_target
    from mlxpipe.serve.fleet_server import FleetPipeline

    with fleet.errors_of(entry):
        target = entry_target(fleet, entry, replica, workload)
        check_draft_flags(entry.draft_model, max_kv_size)
        own = replace(launch, context=entry.context or launch.context,
                      adapter_path=Path(entry.adapter_path) if entry.adapter_path else None,
                      draft_model=entry.draft_model,
                      num_draft_tokens=entry.num_draft_tokens or launch.num_draft_tokens)
        config = settle_config(own.config(target, quiet=False), quiet=False)
    queue = replace(server, prompt_cache_size=_pick(entry.prompt_cache_size, server.prompt_cache_size),
                    prompt_cache_gb=_pick(entry.prompt_cache_gb, server.prompt_cache_gb))
    if entry.draft_model is not None:  # requests one at a time, no disk tier, as a single serve's; the shared
        queue = replace(queue, max_concurrency=None).for_draft()  # --max-concurrency is the other entries'
    return FleetPipeline(entry, replica, config, queue.options(config))


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value
