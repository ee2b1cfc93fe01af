"""``--fleet``: ``plan`` and ``serve`` over a fleet file (``mlxpipe.fleet``) instead of one ``--model``.

The commands keep their one-model flags; with ``--fleet`` the per-model ones move into the file, each entry its
own, so giving one of them as well is refused (``refuse_model_flags``). Here: the option, that check,
``plan --fleet`` (each entry's plan, and the hosts checked against everything they hold together) and
``serve --fleet`` (each entry's pipelines made of the file and the shared flags, behind one endpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from mlxpipe.cluster.hostfile import Hostfile as HostfileValue
    from mlxpipe.fleet.plan import FleetPlan
    from mlxpipe.fleet.spec import Fleet, FleetEntry
    from mlxpipe.serve.fleet_server import FleetPipeline

T = TypeVar("T")

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


@dataclass(frozen=True)
class ServeFlags:
    """The flags of ``serve`` that a fleet's pipelines share (per-model ones are refused beside --fleet, or are the
    entries' defaults where an entry may give its own: context, num-draft-tokens, the prompt cache's sizes)."""

    hostfile: Path | None
    workload: str | None
    host: str
    port: int
    api_key: str | None
    any_model_name: bool
    max_concurrency: int | None
    decode_batch: int
    max_queue: int
    queue_timeout: float
    max_body_size: int
    max_restarts: int
    max_image_mb: float
    max_image_pixels: float
    max_images: int
    allow_image_urls: bool
    image_url_timeout: float
    prompt_cache_size: int
    prompt_cache_gb: float
    prompt_cache_dir: str | None
    max_kv_size: int | None
    context: int | None
    num_draft_tokens: int
    backend: str | None
    prefill_step_size: int | None
    ring_port: int | None
    timeout: float
    trust_remote_code: bool
    from_controller: bool

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> ServeFlags:
        """These flags among ``serve``'s parameters (``ServeFlags.of(locals())``, as ``RequestFlags.of``)."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})


def serve_fleet(fleet_path: Path, params: Mapping[str, Any]) -> int:
    """``mlxpipe serve --fleet``: every entry's pipelines behind one endpoint; the exit status."""
    from mlxpipe.cli._generation import RequestFlags
    from mlxpipe.cli.serve import image_limits
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.fleet.ports import first_ports
    from mlxpipe.launch.batch import check_decode_batch
    from mlxpipe.protocol.checks import at_least, positive
    from mlxpipe.serve.fleet_server import Endpoint
    from mlxpipe.serve.fleet_server import serve_fleet as serve_all

    refuse_model_flags({f"--{k.replace('_', '-')}": params[k] for k in _PER_MODEL})
    flags = ServeFlags.of(params)
    defaults = RequestFlags.of(params).request(Preset())
    limits = image_limits(flags.max_image_mb, flags.max_image_pixels, flags.max_images)
    positive(flags.image_url_timeout, "--image-url-timeout")
    check_decode_batch(flags.decode_batch)
    if flags.max_concurrency is not None:
        at_least(flags.max_concurrency, 1, "--max-concurrency")
    fleet = load(fleet_path, flags.hostfile)
    places = [(entry, replica) for entry in fleet.entries for replica in range(entry.replicas)]
    ports = first_ports([fleet.replica_hostfile(e, r) for e, r in places], flags.ring_port)
    pipelines = [_pipeline(fleet, entry, replica, port, flags)
                 for (entry, replica), port in zip(places, ports, strict=True)]
    endpoint = Endpoint(host=flags.host, port=flags.port, api_key=flags.api_key, defaults=defaults,
                        max_body_bytes=flags.max_body_size, any_model_name=flags.any_model_name, image_limits=limits,
                        image_url_timeout=flags.image_url_timeout if flags.allow_image_urls else None)
    return serve_all(pipelines, fleet.hostfile, endpoint)


# serve's per-model flags, each an entry's key with --fleet (or, --model and --config, the fleet file itself).
_PER_MODEL = ("model", "revision", "strategy", "split", "tp", "layout", "config", "served_model_name", "draft_model",
              "adapter_path")


def _pipeline(fleet: Fleet, entry: FleetEntry, replica: int, port: int, flags: ServeFlags) -> FleetPipeline:
    """One replica's launch config and queue options: the entry's options, else the flags'; checked as a single
    serve checks them, each error naming the fleet file and the entry."""
    from mlxpipe.cli._generation import check_draft_flags, pipeline_config, settle_config
    from mlxpipe.fleet.plan import entry_target
    from mlxpipe.plan.layout import workload as workload_named
    from mlxpipe.serve.fleet_server import FleetPipeline
    from mlxpipe.serve.queue import ServeOptions

    with fleet.errors_of(entry):
        target = entry_target(fleet, entry, replica, workload_named(flags.workload))
        check_draft_flags(entry.draft_model, flags.max_kv_size)
        config = pipeline_config(
            target, backend=flags.backend, prefill_step_size=flags.prefill_step_size, port=port,
            timeout=flags.timeout, trust_remote_code=flags.trust_remote_code, quiet=False,
            from_controller=flags.from_controller, context=entry.context or flags.context,
            adapter_path=Path(entry.adapter_path) if entry.adapter_path else None, draft_model=entry.draft_model,
            num_draft_tokens=entry.num_draft_tokens or flags.num_draft_tokens)
        config = settle_config(config, quiet=False)
    drafting = entry.draft_model is not None  # requests one at a time, no disk tier: as a single serve's
    decode_batch = 1 if drafting else flags.decode_batch
    concurrency = 1 if drafting else flags.max_concurrency
    options = ServeOptions(
        max_concurrency=concurrency if concurrency is not None else config.concurrency(decode_batch),
        max_queue=flags.max_queue, max_restarts=flags.max_restarts, decode_batch=decode_batch,
        prompt_cache_size=_pick(entry.prompt_cache_size, flags.prompt_cache_size),
        queue_timeout=flags.queue_timeout,
        prompt_cache_gb=0.0 if drafting else _pick(entry.prompt_cache_gb, flags.prompt_cache_gb),
        prompt_cache_dir=flags.prompt_cache_dir,
    )
    return FleetPipeline(entry, replica, config, options)


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value
