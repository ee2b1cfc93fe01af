"""Rich renderings of mlxpipe's results (tables for people; JSON goes elsewhere)."""

from __future__ import annotations

from rich.table import Table

from mlxpipe.console import human_bytes
from mlxpipe.plan import Plan


def plan_table(plan: Plan) -> Table:
    """One row per rank, with totals."""
    title = f"{plan.model}  ·  {plan.num_layers} layers  ·  strategy {plan.strategy}"
    t = Table(title=title, title_justify="left", show_footer=True)
    has_memory = any(r.budget_bytes is not None for r in plan.ranks)
    t.add_column("rank", justify="right", footer="total")
    t.add_column("host")
    t.add_column("layers", footer=str(plan.num_layers))
    t.add_column("n", justify="right", footer=str(sum(r.layers for r in plan.ranks)))
    t.add_column("weights", justify="right", footer=human_bytes(plan.model_bytes))
    t.add_column("files", justify="right")
    t.add_column("download", justify="right", footer=human_bytes(sum(r.download_bytes for r in plan.ranks)))
    t.add_column("KV/1k tok", justify="right")
    if has_memory:
        t.add_column("budget", justify="right")
        t.add_column("headroom", justify="right")
        t.add_column("fits", justify="center")
        t.add_column("max context", justify="right")
    for r in plan.ranks:
        row = [
            str(r.rank), r.host, f"{r.start}-{r.end - 1}", str(r.layers), human_bytes(r.weight_bytes),
            str(len(r.files)), human_bytes(r.download_bytes), human_bytes(r.kv_bytes_per_1k),
        ]
        if has_memory:
            fits = "-" if r.fits is None else ("[green]yes[/]" if r.fits else "[bold red]NO[/]")
            ctx = "-" if r.max_context is None else f"{r.max_context:,}"
            row += [human_bytes(r.budget_bytes), human_bytes(r.headroom_bytes), fits, ctx]
        t.add_row(*row)
    return t
