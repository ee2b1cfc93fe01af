"""Rich renderings of mlxpipe's results (tables for people; JSON goes elsewhere)."""

from __future__ import annotations

from rich.table import Table

from mlxpipe.console import short_bytes
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
