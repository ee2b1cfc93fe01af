"""``mlxpipe download``: every host fetches exactly the weight files its ranks need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from mlxpipe import console
from mlxpipe.cli._groups import TargetFlags, option_groups
from mlxpipe.cli._options import Json
from mlxpipe.errors import UsageError

if TYPE_CHECKING:
    from mlxpipe.cluster.hostfile import Hostfile
    from mlxpipe.download.controller import HostReport, HostTask
    from mlxpipe.model.metadata import ModelMetadata


@option_groups
def download(
    flags: TargetFlags,
    rank: Annotated[int | None, typer.Option(
        "--rank", help="Fetch only this rank's files, on this machine.", show_default="every rank, on its host"
    )] = None,
    local: Annotated[bool, typer.Option(
        "--local", help="Alias of --rank for the first rank whose host is 127.0.0.1."
    )] = False,
    from_controller: Annotated[bool, typer.Option(
        "--from-controller",
        help="For hosts without internet: fetch on this machine, then send each host only its files over ssh "
        "(rsync, else scp). Also sends a local model directory.",
    )] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="List each host's files and bytes; fetch nothing."
    )] = False,
    json_out: Json = False,
) -> None:
    """Fetch on every host exactly the weight files its ranks need (plus config and tokenizer).

    Each host downloads into its own cache (hf_home or model_dir from the hostfile, else its
    default Hugging Face cache), in parallel, through huggingface_hub. A second run fetches 0 bytes.
    Hosts without internet: --from-controller fetches here once and sends each host only its files.

    Example: mlxpipe download --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """  # noqa: E501 - the example is one command line, as the help prints it
    from mlxpipe.cli._generation import settle_layout
    from mlxpipe.cluster.target import load_model_metadata, plan_target
    from mlxpipe.download import controller as dl
    from mlxpipe.launch.run import require_fit

    target = flags.target()
    rank = _rank(target.hostfile, rank, local, from_controller)
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, progress=progress)
    if not from_controller:
        dl.require_hub(meta)
    target = settle_layout(target, quiet=json_out, backend=None, context=None, meta=meta).target  # the layout that runs
    the_plan = plan_target(target, meta)
    require_fit(the_plan)  # shares that no run could load are not worth fetching (nor listing: exit 1)
    only = None if rank is None else [rank]
    tasks = dl.host_tasks(the_plan, meta, target.hostfile.hosts, only, here=rank is not None)
    if dry_run:
        if json_out:
            console.print_json(dl.tasks_json(meta, tasks))
        else:
            from mlxpipe.cli.render import tasks_table

            console.out.print(tasks_table(tasks, meta))
        return
    _fetch(tasks, meta, rank, from_controller, json_out)


def _rank(hosts: Hostfile, rank: int | None, local: bool, from_controller: bool) -> int | None:
    """The one rank whose files are fetched here (--rank, or --local's), or None: every rank, on its host."""
    if local and rank is None:
        here = [h.rank for h in hosts.hosts if h.is_local]
        if not here:
            raise UsageError("--local: no host in the hostfile is 127.0.0.1", "use --rank R")
        rank = here[0]
    if rank is not None and not 0 <= rank < hosts.size:
        raise UsageError(f"--rank {rank}: the hostfile has ranks 0-{hosts.size - 1}")
    if rank is not None and from_controller:
        raise UsageError("--from-controller sends every host its files; --rank fetches one rank's here",
                         "give one of them")
    return rank


def _fetch(tasks: list[HostTask], meta: ModelMetadata, rank: int | None, from_controller: bool,
           json_out: bool) -> None:
    """Each task fetched (here, on its host, or sent from here), then what moved."""
    from mlxpipe.cli.render import controller_line, download_table
    from mlxpipe.download import controller as dl
    from mlxpipe.download.progress import download_progress

    controller = None
    reports: list[HostReport]
    with download_progress(tasks, enabled=not json_out) as on_update:
        if from_controller:
            outcome = dl.distribute(tasks, meta, on_update)
            controller, reports = outcome.controller, outcome.reports
        elif rank is not None:
            reports = [dl.run_local(tasks[0], on_update)]
        else:
            reports = dl.run_on_hosts(tasks, on_update)
    if json_out:
        console.print_json(dl.reports_json(meta, reports, controller))
        return
    if controller is not None and controller.result is not None:
        console.out.print(controller_line(controller.result))
    console.out.print(download_table(reports, meta))
    moved = sum(r.result.fetched_bytes for r in reports if r.result)
    if moved == 0:
        console.out.print("Every host already had its files: 0 bytes transferred.")
