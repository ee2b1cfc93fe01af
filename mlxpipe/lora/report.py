"""What ``mlxpipe lora`` prints: mlx_lm.lora's report lines, or one JSON object per line (``--json``)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpipe import console
from mlxpipe.console import human_bytes
from mlxpipe.lora.training import Reporter, StepReport, TrainResult

if TYPE_CHECKING:
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.plan.shard import Plan
    from mlxpipe.plan.training import RankTrainingMemory


class LoraReporter(Reporter):
    """Terminal lines as mlx_lm.lora prints them (stdout), or JSON lines for scripts."""

    def __init__(self, json_out: bool) -> None:
        self.json_out = json_out
        self.memory: dict[int, RankTrainingMemory] = {}

    def _line(self, data: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(data, default=str) + "\n")
        sys.stdout.flush()

    def plan(self, meta: ModelMetadata, the_plan: Plan, memory: list[RankTrainingMemory]) -> None:
        self.memory = {m.rank: m for m in memory}
        if self.json_out:
            self._line({"type": "plan", "split": list(the_plan.split), "ranks": [
                {"rank": r.rank, "host": r.host, "layers": [r.start, r.end], **asdict(self.memory[r.rank]),
                 "total_bytes": self.memory[r.rank].total_bytes}
                for r in the_plan.ranks]})
            return
        for r in the_plan.ranks:
            m = self.memory[r.rank]
            console.err.print(
                f"[dim]rank {r.rank} ({r.host}): layers {r.start}-{r.end - 1}; "
                f"training memory ~{human_bytes(m.total_bytes)}"
                f" = frozen {human_bytes(m.frozen_bytes)} + adapters, gradients, optimizer {human_bytes(m.lora_bytes)}"
                f" + activations of {m.micro_batches_held} micro-batch(es) {human_bytes(m.activation_bytes)}[/]"
            )

    def step(self, report: StepReport) -> None:
        if self.json_out:
            self._line(report.to_json())

    def train(self, it: int, loss: float, lr: float, it_sec: float, tok_sec: float, trained: int, peak: float) -> None:
        if self.json_out:
            self._line({"type": "train", "iteration": it, "train_loss": loss, "learning_rate": lr,
                        "iterations_per_second": it_sec, "tokens_per_second": tok_sec, "trained_tokens": trained,
                        "peak_memory": peak})
            return
        console.out.print(
            f"Iter {it}: Train loss {loss:.3f}, Learning Rate {lr:.3e}, It/sec {it_sec:.3f}, "
            f"Tokens/sec {tok_sec:.3f}, Trained Tokens {trained}, Peak mem {peak:.3f} GB"
        )

    def val(self, it: int, loss: float, seconds: float) -> None:
        if self.json_out:
            self._line({"type": "val", "iteration": it, "val_loss": loss, "val_time": seconds})
            return
        console.out.print(f"Iter {it}: Val loss {loss:.3f}, Val took {seconds:.3f}s")

    def test(self, loss: float) -> None:
        if self.json_out:
            self._line({"type": "test", "test_loss": loss})
            return
        import math

        console.out.print(f"Test loss {loss:.3f}, Test ppl {math.exp(loss):.3f}.")

    def saved(self, it: int, path: Path) -> None:
        if self.json_out:
            self._line({"type": "save", "iteration": it, "path": str(path)})
            return
        console.out.print(f"Iter {it}: Saved adapter weights to {path}.")

    def summary(self, result: TrainResult) -> None:
        if self.json_out:
            self._line(result.to_json())
            return
        if result.saved:
            console.out.print(f"Saved final weights to {result.saved[-1]}.")
        for r in result.ranks:
            estimate = self.memory.get(r.rank)
            planned = f" (estimated {estimate.total_bytes / 1e9:.3f} GB)" if estimate else ""
            console.err.print(
                f"[dim]rank {r.rank} ({r.host}): layers {r.layers[0]}-{r.layers[1] - 1}, "
                f"peak memory {r.peak_memory_gb:.3f} GB{planned}, busy {r.busy:.0%} of the steps' time[/]"
            )
        if result.steps:
            console.err.print(f"[dim]{len(result.steps)} steps, {result.tokens_per_second:.1f} trained tokens/s[/]")
