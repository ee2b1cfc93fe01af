"""``mlxpipe lora``'s run: the model pipelined across the hosts with LoRA on every rank, driven step by step.

This machine, the controller, launches the ranks (``launch.run``), sends each step's batch
(``lora.batches``), reports the loss rank 0 computes, and writes the adapters gathered from every
rank (``lora.adapters``); a rank's side is ``mlxpipe.worker.training.train``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mlxpipe.errors import LaunchError, WireError
from mlxpipe.lora.adapters import ADAPTER_FILE, merge_adapters, save_adapters, write_adapter_config
from mlxpipe.lora.batches import load_datasets, longest_sequence, requests
from mlxpipe.lora.options import TrainOptions
from mlxpipe.protocol.events import Adapter, TrainDone
from mlxpipe.protocol.message import SAME_VERSION, Event
from mlxpipe.protocol.messages import Eval, Save, Step, TrainMessage

if TYPE_CHECKING:
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.pipeline import Pipeline
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.plan.shard import Plan
    from mlxpipe.plan.training import RankTrainingMemory

IN_FLIGHT = 2  # requests sent ahead, so a rank never waits for the controller between steps
N = TypeVar("N", int, float)


@dataclass
class StepReport:
    """One optimizer step, as rank 0 and the clock saw it."""

    iteration: int
    loss: float
    tokens: int
    learning_rate: float
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"type": "step", **asdict(self)}


@dataclass
class RankMemory:
    rank: int
    host: str
    layers: tuple[int, int]
    peak_memory_gb: float
    busy: float  # share of the training steps' time spent computing (the rest: waiting on sends and receives)


@dataclass
class TrainResult:
    steps: list[StepReport] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    test_loss: float | None = None
    saved: list[str] = field(default_factory=list)
    ranks: list[RankMemory] = field(default_factory=list)
    train_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        tokens = sum(s.tokens for s in self.steps)
        return tokens / self.train_seconds if self.train_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"type": "summary", "iterations": len(self.steps), "val_losses": self.val_losses,
                "test_loss": self.test_loss, "saved": self.saved, "train_seconds": self.train_seconds,
                "tokens_per_second": self.tokens_per_second, "ranks": [asdict(r) for r in self.ranks]}


class Reporter:
    """What the run tells the user; the CLI gives one (terminal lines or --json)."""

    def plan(self, meta: ModelMetadata, the_plan: Plan, memory: list[RankTrainingMemory]) -> None: ...
    def step(self, report: StepReport) -> None: ...
    def train(
        self, it: int, loss: float, lr: float, it_sec: float, tok_sec: float, trained: int, peak: float
    ) -> None: ...
    def val(self, it: int, loss: float, seconds: float) -> None: ...
    def test(self, loss: float) -> None: ...
    def saved(self, it: int, path: Path) -> None: ...


class Training:
    """Drive the ranks of a loaded pipeline through the run's messages."""

    def __init__(self, pipe: Pipeline, options: TrainOptions, reporter: Reporter) -> None:
        self.pipe, self.options, self.reporter = pipe, options, reporter
        self.size = pipe.ranks.size
        self.result = TrainResult()
        self._window: collections.deque[TrainMessage] = collections.deque()
        self._answers: dict[int, dict[int, TrainDone]] = collections.defaultdict(dict)  # id -> rank -> its done
        self._adapters: dict[int, dict[int, str]] = collections.defaultdict(dict)  # id -> rank -> base64
        self._peaks: dict[int, float] = {}
        self._busy: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # rank -> compute, step s
        self._since = 0.0
        self._pending: list[StepReport] = []

    def run(self, todo: Iterator[TrainMessage]) -> TrainResult:
        self._since = time.perf_counter()
        todo = iter(todo)
        events = self.pipe.events(self.pipe.config.timeout)
        while True:
            # Nothing is sent past a save until it is written: a rank failing later cannot lose it.
            while len(self._window) < IN_FLIGHT and not any(isinstance(r, Save) for r in self._window):
                message = next(todo, None)
                if message is None:
                    break
                self.pipe.ranks.send(message)
                self._window.append(message)
            if not self._window:
                break
            self._wait(self._window[0], events)
            self._finish(self._window.popleft())
        self.result.ranks = [
            RankMemory(s.rank, s.host, (s.start, s.end), max(s.peak_memory_gb, self._peaks.get(s.rank, 0.0)),
                       self._busy[s.rank][0] / self._busy[s.rank][1] if self._busy[s.rank][1] else 0.0)
            for s in sorted(self.pipe.loaded.values(), key=lambda s: s.rank)
        ]
        return self.result

    def _wait(self, message: TrainMessage, events: Iterator[Event]) -> None:
        while len(self._answers[message.id]) < self.size:
            event = next(events, None)
            if event is None:
                raise LaunchError("the ranks ended in the middle of training", f"logs: {self.pipe.run_dir}")
            if isinstance(event, TrainDone):
                self._answers[event.id][event.rank] = event
                self._peaks[event.rank] = max(self._peaks.get(event.rank, 0.0), event.peak_memory)
            elif isinstance(event, Adapter):
                self._adapters[event.id][event.rank] = event.data

    def _finish(self, message: TrainMessage) -> None:
        answers = self._answers.pop(message.id)
        now = time.perf_counter()
        seconds, self._since = now - self._since, now
        zero = answers[0]
        if isinstance(message, Step):
            for rank, a in answers.items():
                self._busy[rank][0] += _found(a.compute_seconds, "compute_seconds")
                self._busy[rank][1] += a.seconds
            report = StepReport(message.it, _found(zero.loss, "loss"), _found(zero.ntoks, "ntoks"),
                                _found(zero.learning_rate, "learning_rate"), seconds)
            self.result.steps.append(report)
            self.result.train_seconds += seconds
            self.reporter.step(report)
            self._pending.append(report)
            if message.it % self.options.steps_per_report == 0 or message.it == self.options.iters:
                self._report_train(message.it)
        elif isinstance(message, Eval):
            loss = _found(zero.loss_sum, "loss_sum") / max(_found(zero.ntoks, "ntoks"), 1)
            if message.what == "test" or message.it is None:
                self.result.test_loss = loss
                self.reporter.test(loss)
            else:
                # The slowest rank's own time: with requests sent ahead, completions say little about one request.
                took = max(a.seconds for a in answers.values())
                self.result.val_losses[message.it] = loss
                self.reporter.val(message.it, loss, took)
        elif isinstance(message, Save):
            self._save(message, answers)

    def _save(self, message: Save, answers: dict[int, TrainDone]) -> None:
        parts = self._adapters.pop(message.id, {})
        for rank, answer in answers.items():
            if answer.tensors and not parts.get(rank):
                # Its frames were garbled beyond repair (the run fails on that too): never
                # write adapters without that rank's layers.
                raise LaunchError(f"rank {rank}'s adapters did not reach this machine whole",
                                  f"nothing was written; logs: {self.pipe.run_dir}")
        weights = merge_adapters(parts)
        folder = Path(self.options.adapter_path)
        save_adapters(weights, folder / ADAPTER_FILE)
        self.result.saved.append(str(folder / ADAPTER_FILE))
        if message.checkpoint:
            checkpoint = folder / f"{message.it:07d}_{ADAPTER_FILE}"
            save_adapters(weights, checkpoint)
            self.result.saved.append(str(checkpoint))
            self.reporter.saved(message.it, checkpoint)

    def _report_train(self, it: int) -> None:
        steps, self._pending = self._pending, []
        seconds = sum(s.seconds for s in steps) or 1e-9
        tokens = sum(s.tokens for s in steps)
        trained = sum(s.tokens for s in self.result.steps)
        self.reporter.train(it, sum(s.loss for s in steps) / len(steps), steps[-1].learning_rate,
                            len(steps) / seconds, tokens / seconds, trained, max(self._peaks.values(), default=0.0))


def _found(value: N | None, name: str) -> N:
    """A figure rank 0's ``done`` carries for this kind of message; its absence is a broken contract."""
    if value is None:
        raise WireError(f"a training rank's 'done' event lacks its {name}", SAME_VERSION)
    return value


def train(config: PipelineConfig, options: TrainOptions, reporter: Reporter) -> TrainResult:
    """Plan, check, download, launch with LoRA on every rank, train, and write the adapters.

    ``config`` is the ``PipelineConfig``; the reporter sees the plan and the memory estimate before launch.
    """
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.launch.run import launch, prepare
    from mlxpipe.plan.training import training_memory

    meta, the_plan = prepare(config, training=True)
    data = load_datasets(options, controller_model_dir(meta))
    reporter.plan(meta, the_plan, training_memory(meta, the_plan, options, longest_sequence(data.train)))
    resume = Path(options.resume_adapter_file).read_bytes() if options.resume_adapter_file else None
    if options.train:
        write_adapter_config(options, meta.source)
    pipe = launch(config, meta, the_plan, train=options.for_ranks())
    try:
        result = Training(pipe, options, reporter).run(requests(options, data, resume))
    except BaseException:
        pipe.stop()
        raise
    pipe.close()
    return result
