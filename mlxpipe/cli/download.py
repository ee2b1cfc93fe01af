"""``mlxpipe download``: every host fetches exactly the weight files its ranks need."""

from __future__ import annotations

from typing import Annotated

import typer

from mlxpipe import console
from mlxpipe.cli._options import (
    Config,
    Hostfile,
    Json,
    LayoutOption,
    Model,
    Revision,
    Split,
    Strategy,
    Tp,
    WorkloadOption,
    parse_split,
)
from mlxpipe.errors import UsageError


def download(
    model: Model = None,
    hostfile: Hostfile = None,
    revision: Revision = None,
    strategy: Strategy = None,
    split: Split = None,
    tp: Tp = None,
    layout: LayoutOption = None,
    workload: WorkloadOption = None,
    config: Config = None,
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
    from mlxpipe.cli.render import controller_line, download_table, tasks_table
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target
    from mlxpipe.download import controller as dl
    from mlxpipe.download.progress import download_progress
    from mlxpipe.launch.run import require_fit

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp, layout, workload)
    hosts = target.hostfile.hosts
    if local and rank is None:
        here = [h.rank for h in hosts if h.is_local]
        if not here:
            raise UsageError("--local: no host in the hostfile is 127.0.0.1", "use --rank R")
        rank = here[0]
    if rank is not None and not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the hostfile has ranks 0-{len(hosts) - 1}")
    if rank is not None and from_controller:
        raise UsageError("--from-controller sends every host its files; --rank fetches one rank's here",
                         "give one of them")
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, progress=progress)
    if not from_controller:
        dl.require_hub(meta)
    target = settle_layout(target, quiet=json_out, backend=None, context=None, meta=meta).target  # the layout that runs
    the_plan = plan_target(target, meta)
    require_fit(the_plan)  # shares that no run could load are not worth fetching (nor listing: exit 1)
    tasks = dl.host_tasks(the_plan, meta, hosts, None if rank is None else [rank], here=rank is not None)
    if dry_run:
        if json_out:
            console.print_json(dl.tasks_json(meta, tasks))
        else:
            console.out.print(tasks_table(tasks, meta))
        return
    controller = None
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



