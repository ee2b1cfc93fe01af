"""The ``mlxpipe`` command line: thin commands over the core modules.

Each command checks its flags, builds plain values, calls the core and renders
the result. Errors raised on purpose (``MlxpipeError``) become one line plus a
hint; exit codes: 0 success, 1 failure (a failed rank included), 2 usage error.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import typer

from mlxpipe import console
from mlxpipe.errors import MlxpipeError, UsageError

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="mlxpipe",
    help=(
        "Run LLMs too large for one Mac as a pipeline across several.\n\n"
        "  mlxpipe plan      which layers each host runs, and whether it fits\n\n"
        "  mlxpipe download  each host fetches only its own weight files\n\n"
        "  mlxpipe generate  run the pipeline and stream the answer\n\n"
        "Exit codes: 0 success, 1 failure (any failed rank included), 2 usage error."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_DEBUG_ENV = "MLXPIPE_DEBUG"


def _boundary(fn: F) -> F:
    """The one error boundary: known errors -> one line + hint + exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MlxpipeError as e:
            if os.environ.get(_DEBUG_ENV):
                raise
            console.error(e.message, e.hint)
            raise typer.Exit(2 if isinstance(e, UsageError) else 1) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    if debug:
        os.environ[_DEBUG_ENV] = "1"


# --- Shared options ----------------------------------------------------------------

ModelOpt = typer.Option(None, "--model", "-m", help="Hub repo id or local directory. [default: the demo model]")
RevisionOpt = typer.Option(None, "--revision", help="Hub branch, tag or commit.")
HostfileOpt = typer.Option(None, "--hostfile", help="mlx.launch hostfile (JSON or YAML). [default: hostfiles/local-2.json]")
StrategyOpt = typer.Option(None, "--strategy", help="even | memory. [default: memory when every host has memory_gb, else even]")
SplitOpt = typer.Option(None, "--split", help="Layers per rank in rank order, e.g. 10,12,8 (rank 0 runs the LAST layers).")
ConfigOpt = typer.Option(None, "--config", help="A preset from configs/*.yaml; flags override it.")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``"10,12,8"`` -> ``(10, 12, 8)``."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--split {text!r}: expected comma-separated layer counts such as 10,12,8") from None


@app.command()
@_boundary
def plan(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    context: int = typer.Option(4096, "--context", help="Context length (tokens) the fit check reserves KV cache for."),
    refresh: bool = typer.Option(False, "--refresh", help="Re-read metadata from the hub even if cached."),
    json_out: bool = JsonOpt,
) -> None:
    """Show which layers each host runs, what it must hold and fetch, and whether it fits.

    Reads only metadata (config, weight index, safetensors headers): no weights.

    Example: mlxpipe plan --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2.json
    """
    from mlxpipe.render import plan_table
    from mlxpipe.target import load_model_metadata, plan_target, resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
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


@app.command()
@_boundary
def download(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    rank: Optional[int] = typer.Option(None, "--rank", help="Fetch only this rank's files, on this machine."),
    local: bool = typer.Option(False, "--local", help="Alias of --rank for the rank whose host is this machine (127.0.0.1)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List each host's files and bytes; fetch nothing."),
    json_out: bool = JsonOpt,
) -> None:
    """Fetch on every host exactly the weight files its ranks need (plus config and tokenizer).

    Each host downloads into its own cache (hf_home or model_dir from the hostfile, else its
    default Hugging Face cache), in parallel, through huggingface_hub. A second run fetches 0 bytes.

    Example: mlxpipe download --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """
    from mlxpipe import download as dl
    from mlxpipe.render import download_table, download_progress, tasks_table
    from mlxpipe.target import load_model_metadata, plan_target, resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    hosts = target.hostfile.hosts
    if local and rank is None:
        locals_ = [h.rank for h in hosts if h.is_local]
        if not locals_:
            raise UsageError("--local: no host in the hostfile is 127.0.0.1", "use --rank R")
        rank = locals_[0]
    if rank is not None and not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the hostfile has ranks 0-{len(hosts) - 1}")
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, progress=progress)
    the_plan = plan_target(target, meta)
    tasks = dl.host_tasks(the_plan, meta, hosts, None if rank is None else [rank])
    if dry_run:
        if json_out:
            console.print_json([{"host": t.host.ssh, "ranks": list(t.ranks), "files": list(t.job.files),
                                 "bytes": t.total_bytes} for t in tasks])
        else:
            console.out.print(tasks_table(tasks, meta))
        return
    with download_progress(tasks, enabled=not json_out) as on_update:
        if rank is not None:
            reports = [dl.run_local(tasks[0], on_update)]
        else:
            reports = dl.run_on_hosts(tasks, on_update)
    if json_out:
        console.print_json([{"host": r.task.host.ssh, "ranks": list(r.task.ranks), "path": r.result.path,
                             "fetched_bytes": r.result.fetched_bytes, "present_bytes": r.result.present_bytes,
                             "model_bytes": meta_total(meta), "files": list(r.task.job.files)}
                            for r in reports if r.result])
        return
    console.out.print(download_table(reports, meta))
    fetched = sum(r.result.fetched_bytes for r in reports if r.result)
    if fetched == 0:
        console.out.print("Every host already had its files: 0 bytes transferred.")


def meta_total(meta: Any) -> int:
    return sum(meta.file_sizes.values())


def main() -> None:
    app()
