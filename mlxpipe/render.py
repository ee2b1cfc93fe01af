"""Rich renderings of mlxpipe's results (tables for people; JSON goes elsewhere)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from rich.table import Table

from mlxpipe.console import err, short_bytes
from mlxpipe.plan import Plan


def plan_table(plan: Plan) -> Table:
    """One row per rank, with totals; sizes in binary units (K = KiB, G = GiB)."""
    title = f"{plan.model}  ·  {plan.num_layers} layers  ·  strategy {plan.strategy}"
    t = Table(title=title, title_justify="left", show_footer=True, padding=(0, 1))
    has_memory = any(r.budget_bytes is not None for r in plan.ranks)
    total_download = sum(r.download_bytes for r in plan.ranks)
    t.add_column("rank", justify="right", footer="total", min_width=5)
    t.add_column("host", min_width=9, overflow="fold")
    t.add_column("layers", footer=str(plan.num_layers), no_wrap=True)
    t.add_column("weights", justify="right", footer=short_bytes(plan.model_bytes), no_wrap=True)
    t.add_column("download", justify="right", footer=short_bytes(total_download), no_wrap=True)
    t.add_column("KV/1k", justify="right", no_wrap=True)
    if has_memory:
        t.add_column("budget", justify="right", no_wrap=True)
        t.add_column("free", justify="right", no_wrap=True)
        t.add_column("fits", justify="center", no_wrap=True)
        t.add_column("max ctx", justify="right", no_wrap=True)
    for r in plan.ranks:
        row = [
            str(r.rank), r.host, f"{r.start}-{r.end - 1} ({r.layers})", short_bytes(r.weight_bytes),
            f"{short_bytes(r.download_bytes)} in {len(r.files)}", short_bytes(r.kv_bytes_per_1k),
        ]
        if has_memory:
            fits = "-" if r.fits is None else ("[green]yes[/]" if r.fits else "[bold red]NO[/]")
            ctx = "-" if r.max_context is None else f"{r.max_context:,}"
            row += [short_bytes(r.budget_bytes), short_bytes(r.headroom_bytes), fits, ctx]
        t.add_row(*row)
    return t


def tasks_table(tasks: Sequence[Any], meta: Any) -> Table:
    """``download --dry-run``: each host's files and bytes."""
    whole = sum(meta.file_sizes.values())
    t = Table(title=f"{meta.source} @ {(meta.commit or '')[:12]}: files per host", title_justify="left")
    for name, justify in (("host", "left"), ("ranks", "left"), ("files", "left"), ("bytes", "right"), ("of model", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for task in tasks:
        files = "\n".join(task.job.files)
        share = f"{100 * task.total_bytes / whole:.0f}%" if whole else "-"
        t.add_row(task.host.ssh, ",".join(map(str, task.ranks)), files, short_bytes(task.total_bytes), share)
    return t


def download_table(reports: Sequence[Any], meta: Any) -> Table:
    """After ``download``: what each host fetched and already had."""
    whole = sum(meta.file_sizes.values())
    t = Table(title=f"{meta.source} @ {(meta.commit or '')[:12]}", title_justify="left")
    for name in ("host", "ranks", "files", "fetched", "already present", "whole model", "path"):
        t.add_column(name, justify="left" if name in ("host", "ranks", "path") else "right")
    for r in reports:
        res = r.result
        t.add_row(
            r.task.host.ssh, ",".join(map(str, r.task.ranks)), str(len(r.task.job.files)),
            short_bytes(res.fetched_bytes), short_bytes(res.present_bytes), short_bytes(whole), res.path,
        )
    return t


@contextmanager
def download_progress(tasks: Sequence[Any], enabled: bool = True) -> Iterator[Any]:
    """One Rich progress bar per host (bytes, rate, ETA); yields the update callback."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(), console=err,
    )
    ids = {id(t): progress.add_task(t.host.ssh, total=t.total_bytes) for t in tasks}
    with progress:
        yield lambda report: progress.update(ids[id(report.task)], completed=report.done_bytes)


def answer_table(answer: Any) -> Table:
    """The summary after a generation: speed overall and memory per rank."""
    ttft = "-" if answer.ttft is None else f"{answer.ttft:.2f} s"
    t = Table(
        title=(
            f"prompt {answer.prompt_tokens} tok @ {answer.prompt_tps:.1f} tok/s  ·  "
            f"generation {answer.generation_tokens} tok @ {answer.generation_tps:.1f} tok/s  ·  "
            f"first token {ttft}"
        ),
        title_justify="left",
    )
    for name in ("rank", "host", "layers", "peak memory", "load"):
        t.add_column(name, justify="right" if name in ("rank", "peak memory", "load") else "left")
    for r in answer.ranks:
        load = "-" if r.load_seconds is None else f"{r.load_seconds:.1f} s"
        t.add_row(str(r.rank), r.host, f"{r.start}-{r.end - 1}", f"{r.peak_memory_gb:.2f} GB", load)
    return t
