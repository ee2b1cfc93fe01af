"""Where the ranks' time goes: the controller's reading of each rank's ``TimeSpent`` report.

Every rank's engine counts its seconds computing, handing on, waiting for the rank before it,
in the per-tick collective and idle (``worker/generation/engine.py``) and sends them in its ``time`` event.
Here the controller turns those reports into what a person asks of a pipeline: how busy each
stage is, how long each hop waits, and which stage is the bottleneck. ``generate
--prompts-file``'s summary (``launch/batch.py``) and ``serve``'s ``/health`` (and its page) show it.
"""

from __future__ import annotations

from typing import Any


def where_time_goes(times: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Each rank's busy fraction and each hop's wait, from the ranks' ``TimeSpent`` reports.

    A rank is busy while it computes its stage; otherwise it waits: for its
    input from the rank before it (the hop's wait: that stage was slower, or the
    link), to hand its output on (``send``), or in the per-tick collective for
    rank 0's tokens (``sync``). The slowest stage is the one busiest: when its
    busy fraction is far above the others', the split is the bottleneck; when
    every stage is lightly busy and the hops wait, the network is.
    """
    if not times:
        return {}
    ranks = [
        {"rank": r, "busy": t["busy"], **{f"{k}_s": t[k] for k in ("compute", "send", "recv", "sync", "idle")},
         "vision_s": t.get("vision", 0.0)}  # of compute_s (a report from an older rank has none)
        for r, t in sorted(times.items())
    ]
    # Stages run from the highest rank to rank 0: the hop into rank r comes from rank r + 1.
    hops = [{"from": r + 1, "to": r, "wait_s": times[r]["recv"]} for r in sorted(times) if r + 1 in times]
    slowest = max(ranks, key=lambda t: t["busy"])
    return {"ranks": ranks, "hops": hops, "busiest_rank": slowest["rank"]}
