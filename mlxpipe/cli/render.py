"""Rich renderings of mlxpipe's results (tables for people; JSON goes elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mlxpipe.console import short_bytes
from mlxpipe.plan.shard import Plan

if TYPE_CHECKING:
    from mlxpipe.cluster.check_result import CheckResult
    from mlxpipe.download.controller import HostReport, HostTask
    from mlxpipe.launch.batch import BatchResult
    from mlxpipe.launch.pipeline import Answer
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.protocol.fetch_events import FetchResult


def plan_table(plan: Plan) -> RenderableType:
    """One row per rank, with totals; sizes in binary units (K = KiB, G = GiB). With --tp, each rank's
    stage and place in the stage's tensor-parallel group ("1 · 0": stage 1, first member)."""
    title = f"{plan.model}  ·  {plan.num_layers} layers  ·  strategy {plan.strategy}"
    if plan.tp > 1:
        title += f"  ·  --tp {plan.tp}: {len(plan.split)} stage{'s' if len(plan.split) > 1 else ''} of {plan.tp} ranks"
    t = Table(show_footer=True, padding=(0, 1))
    has_memory = any(r.budget_bytes is not None for r in plan.ranks)
    total_download = sum(r.download_bytes for r in plan.ranks)
    t.add_column("rank", justify="right", footer="total", min_width=5)
    if plan.tp > 1:
        t.add_column("stage · tp", no_wrap=True)
    t.add_column("host", min_width=9, overflow="fold")
    t.add_column("layers", footer=str(plan.num_layers), no_wrap=True)
    t.add_column("weights", justify="right", footer=short_bytes(plan.model_bytes), no_wrap=True)
    t.add_column("download", justify="right", footer=short_bytes(total_download), no_wrap=True)
    t.add_column("KV/1k", justify="right", no_wrap=True)
    t.add_column("work/token", justify="right", no_wrap=True)
    if has_memory:
        t.add_column("budget", justify="right", no_wrap=True)
        t.add_column("free", justify="right", no_wrap=True)
        t.add_column("fits", justify="center", no_wrap=True)
        t.add_column("max ctx", justify="right", no_wrap=True)
    for r in plan.ranks:
        row = [
            str(r.rank), *([f"{r.stage} · {r.tp_index}"] if plan.tp > 1 else []), r.host,
            f"{r.start}-{r.end - 1} ({r.layers})", short_bytes(r.weight_bytes),
            f"{short_bytes(r.download_bytes)} in {len(r.files)}", short_bytes(r.kv_bytes_per_1k),
            f"{r.work_share:.0%}",
        ]
        if has_memory:
            fits = "-" if r.fits is None else ("[green]yes[/]" if r.fits else "[bold red]NO[/]")
            ctx = "-" if r.max_context is None else f"{r.max_context:,}"
            row += [short_bytes(r.budget_bytes), short_bytes(r.headroom_bytes), fits, ctx]
        t.add_row(*row)
    return titled(title, t)


def tasks_table(tasks: Sequence[HostTask], meta: ModelMetadata) -> RenderableType:
    """``download --dry-run``: each host's files and bytes."""
    whole = sum(meta.file_sizes.values())
    title = f"{_model_title(meta)}: files per host"
    t = Table()
    columns = (("host", "left"), ("ranks", "left"), ("files", "left"), ("bytes", "right"), ("of model", "right"))
    for name, justify in columns:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for task in tasks:
        files = "\n".join(task.job.files)
        share = f"{100 * task.total_bytes / whole:.0f}%" if whole else "-"
        t.add_row(task.host.ssh, _ranks(task.ranks), files, short_bytes(task.total_bytes), share)
    return titled(title, t)


def download_table(reports: Sequence[HostReport], meta: ModelMetadata) -> RenderableType:
    """After ``download``: what each host holds, what this run moved to it, and how."""
    whole = sum(meta.file_sizes.values())
    title = _model_title(meta)
    t = Table()
    via = any(r.via != "hub" for r in reports)
    columns = ["host", "ranks", "files", "fetched", "already present", "whole model", *(["via"] if via else []), "path"]
    for name in columns:
        t.add_column(name, justify="left" if name in ("host", "ranks", "via", "path") else "right")
    for r in reports:
        res = r.result
        assert res is not None  # a host without a result failed the download (_raise_first_failure)
        row = [
            r.task.host.ssh, _ranks(r.task.ranks), str(len(r.task.job.files)),
            short_bytes(res.fetched_bytes), short_bytes(res.present_bytes), short_bytes(whole),
            *([r.via] if via else []), res.path,
        ]
        t.add_row(*row)
    return titled(title, t)


def controller_line(result: FetchResult) -> str:
    """``--from-controller``: what the controller took from the hub before sending."""
    return (
        f"controller: fetched {short_bytes(result.fetched_bytes)} from the hub "
        f"({short_bytes(result.present_bytes)} already cached) into {result.path}"
    )


def titled(title: str, table: Table) -> RenderableType:
    """A table under a title line (a Table's own title wraps to the table's width)."""
    return Group(Text(title, style="bold"), table)


def _model_title(meta: ModelMetadata) -> str:
    return f"{meta.source} @ {meta.commit[:12]}" if meta.commit else str(meta.source)


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) or "-"


def answer_table(answer: Answer) -> RenderableType:
    """The summary after a generation: speed overall and memory per rank."""
    ttft = "-" if answer.ttft is None else f"{answer.ttft:.2f} s"
    title = (
        f"prompt {answer.prompt_tokens} tok @ {answer.prompt_tps:.1f} tok/s  ·  "
        f"generation {answer.generation_tokens} tok @ {answer.generation_tps:.1f} tok/s  ·  "
        f"first token {ttft}"
    )
    if answer.draft_tokens is not None:
        title += f"  ·  {answer.draft_tokens} of {answer.generation_tokens} drafted"
    t = Table()
    groups = any(r.stage is not None for r in answer.ranks)  # --tp: the stage and place in its group
    for name in ("rank", *(["stage · tp"] if groups else []), "host", "layers", "peak memory", "load"):
        t.add_column(name, justify="right" if name in ("rank", "peak memory", "load") else "left")
    for r in answer.ranks:
        load = "-" if r.load_seconds is None else f"{r.load_seconds:.1f} s"
        group = [f"{r.stage} · {r.tp_index}"] if groups else []
        t.add_row(str(r.rank), *group, r.host, f"{r.start}-{r.end - 1}", f"{r.peak_memory_gb:.2f} GB", load)
    return titled(title, t)


def batch_table(result: BatchResult) -> RenderableType:
    """The summary after ``generate --prompts-file``: the batch's throughput, then each request."""
    title = (
        f"{len(result.results)} requests, {result.concurrency} at a time  ·  "
        f"generated {result.generation_tokens} tok in {result.seconds:.1f} s  ·  "
        f"aggregate {result.aggregate_tps:.1f} tok/s"
    )
    t = Table()
    for name in ("id", "prompt", "generated", "finish", "first token", "latency", "tok/s"):
        t.add_column(name, justify="left" if name in ("id", "finish") else "right")
    for r in result.results:
        t.add_row(
            str(r.id), str(r.prompt_tokens), str(r.generation_tokens), r.finish_reason or "-",
            f"{r.ttft:.2f} s", f"{r.latency:.2f} s", f"{r.tps:.1f}",
        )
    spent = time_table(result.summary()["time"])
    return Group(titled(title, t), spent) if spent is not None else titled(title, t)


def time_table(report: dict[str, Any]) -> RenderableType | None:
    """Where each rank's time went (``launch.timing.where_time_goes``): busy computing, or waiting on what."""
    if not report:
        return None
    t = Table()
    for name in ("rank", "busy", "computing", "waiting for input", "sending", "waiting for tokens"):
        t.add_column(name, justify="right")
    for r in report["ranks"]:
        hop = f"{r['recv_s']:.2f} s (from rank {r['rank'] + 1})" if r["recv_s"] > 0 else "-"
        t.add_row(str(r["rank"]), f"{r['busy']:.0%}", f"{r['compute_s']:.2f} s", hop,
                  f"{r['send_s']:.2f} s", f"{r['sync_s']:.2f} s")
    return titled(f"where the time went  ·  busiest: rank {report['busiest_rank']}", t)


_STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


def doctor_table(results: Sequence[CheckResult]) -> Table:
    """``mlxpipe doctor``: one row per check and host, with the fix for each failure."""
    from rich.markup import escape

    t = Table(title="mlxpipe doctor", title_justify="left", padding=(0, 1))
    t.add_column("host", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("status", justify="center", no_wrap=True)
    t.add_column("detail", overflow="fold")
    t.add_column("fix", overflow="fold")
    previous = None
    for r in results:
        # The host's name once per group of rows; hostfile values are escaped, never read as markup.
        label = f"rank{'s' if len(r.ranks) > 1 else ''} {_ranks(r.ranks)}"
        host = "" if (r.host, r.ranks) == previous else f"{escape(r.host)} [dim]({label})[/]"
        previous = (r.host, r.ranks)
        t.add_row(host, r.check, _STATUS_STYLE.get(r.status, r.status), escape(r.detail), escape(r.fix or ""))
    return t


# --- the cluster's facts and the layouts (``doctor --links``, ``plan``) ----------------------------------------


def link_lines(facts: Any) -> list[str]:
    """One line per measured link: ``rank 0 (a) <-> rank 1 (b): 48 us, 2.1 GB/s``."""
    hosts = facts.hosts
    lines = [f"rank {a} ({hosts[a].ssh}) <-> rank {b} ({hosts[b].ssh}): {microseconds(link.latency)}, "
             f"{link.bandwidth / 1e9:.2f} GB/s" for link in facts.links for a, b in [link.ranks]]
    if facts.collective is not None:
        lines.append(f"all-reduce of {len(hosts)} ranks: {microseconds(facts.collective)}")
    return lines


def microseconds(seconds: float) -> str:
    """``0.000048`` -> ``48 us``; ``0.0051`` -> ``5.10 ms``."""
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def facts_table(facts: Any, path: Any) -> RenderableType:
    """``doctor --links``: each machine's figures, then each link's."""
    hosts = Table(padding=(0, 1))
    for name, justify in (("rank", "right"), ("host", "left"), ("chip", "left"), ("memory bandwidth", "right"),
                          ("source", "left"), ("matmul", "right"), ("calibrated: decode", "right"),
                          ("prefill", "right"), ("per layer", "right")):
        hosts.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for h in facts.hosts:
        c = h.calibration
        calibrated = ([f"{c.decode_bandwidth / 1e9:.1f} GB/s", f"{c.prefill_flops / 1e9:.1f} GFLOP/s",
                       microseconds(c.layer_overhead)] if c is not None else ["-", "-", "-"])
        hosts.add_row(str(h.rank), h.ssh, f"{h.chip} ({h.device})", f"{h.memory_bandwidth / 1e9:.1f} GB/s",
                      h.memory_bandwidth_source, f"{h.compute / 1e9:.1f} GFLOP/s", *calibrated)
    links = Table(padding=(0, 1))
    for name in ("ranks", "hosts", "latency", "bandwidth", "round trips"):
        links.add_column(name, justify="left" if name in ("ranks", "hosts") else "right")
    for link in facts.links:
        a, b = link.ranks
        links.add_row(f"{a} <-> {b}", f"{facts.hosts[a].ssh} <-> {facts.hosts[b].ssh}", microseconds(link.latency),
                      f"{link.bandwidth / 1e9:.2f} GB/s", str(link.rounds))
    parts: list[RenderableType] = [Text(f"cluster facts ({facts.backend} backend): {path}", style="bold"), hosts]
    if facts.links:
        parts.append(links)
    if facts.collective is not None:
        every = microseconds(facts.collective)
        parts.append(Text(f"all-reduce of {len(facts.hosts)} ranks (every engine tick): {every}"))
    return Group(*parts)


def layouts_table(choice: Any) -> RenderableType:
    """``plan``: every feasible layout with its predicted figures, the chosen one first."""
    first = choice.candidates[0].estimate if choice.candidates else None
    title = f"layouts for {choice.workload.describes}"
    if not choice.measured:
        title += " (no measured facts: nominal hosts and links)"
    t = Table(padding=(0, 1))
    t.add_column("layout", overflow="fold")
    t.add_column("flags", overflow="fold")
    t.add_column("decode tok/s", justify="right")
    t.add_column(f"prefill tok/s ({first.prompt:,} tok)" if first else "prefill tok/s", justify="right")
    t.add_column(f"{first.concurrency} at once tok/s" if first else "aggregate tok/s", justify="right")
    t.add_column("s / request", justify="right")
    for i, c in enumerate(choice.candidates):
        e = c.estimate
        name = f"[bold]{c.name}[/] (chosen)" if i == 0 else c.name
        t.add_row(name, c.layout.flags or "-", f"{e.decode:.1f}", f"{e.prefill:.1f}", f"{e.aggregate:.1f}",
                  f"{e.score:.2f}")
    for name, why in choice.refused:
        t.add_row(f"[dim]{name}[/]", "-", "-", "-", "-", f"[dim]{why}[/]")
    return titled(title, t)
