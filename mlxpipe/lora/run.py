"""``mlxpipe lora``: LoRA fine-tuning of a model pipelined across the hosts.

mlx_lm.lora's options, data formats, batches and outputs; the model's layers
split across the ranks (``mlxpipe.worker.training.train``). This machine, the
controller, reads the data and makes every batch exactly as mlx_lm.lora does
(``iterate_batches`` with the same seed and the same draws in the same order),
sends each step's batch to the ranks, reports the loss rank 0 computes, and
writes the adapters gathered from every rank in mlx-lm's format.
"""

from __future__ import annotations

import base64
import collections
import itertools
import time
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mlxpipe.errors import ConfigError, LaunchError, UsageError, WireError
from mlxpipe.paths import replacing
from mlxpipe.protocol.checks import one_of
from mlxpipe.protocol.events import Adapter, TrainDone
from mlxpipe.protocol.job import FINE_TUNE_TYPES, OPTIMIZERS, TrainSpec
from mlxpipe.protocol.message import SAME_VERSION, Event
from mlxpipe.protocol.messages import Eval, Resume, Save, Step, TrainMessage
from mlxpipe.worker.training.train_schedule import SCHEDULES

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.pipeline import Pipeline
    from mlxpipe.model.metadata import ModelMetadata
    from mlxpipe.plan.shard import Plan
    from mlxpipe.plan.training import RankTrainingMemory

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
IN_FLIGHT = 2  # requests sent ahead, so a rank never waits for the controller between steps
N = TypeVar("N", int, float)


@dataclass
class TrainOptions:
    """mlx_lm.lora's options (same names and defaults) plus the pipeline's."""

    model: str | None = None
    train: bool = False
    test: bool = False
    data: str = "data"
    fine_tune_type: str = "lora"
    optimizer: str = "adam"
    optimizer_config: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}}
    )
    mask_prompt: bool = False
    num_layers: int = 16
    batch_size: int = 4
    iters: int = 1000
    val_batches: int = 25
    test_batches: int = 500
    learning_rate: float = 1e-5
    steps_per_report: int = 10
    steps_per_eval: int = 200
    resume_adapter_file: str | None = None
    adapter_path: str = "adapters"
    save_every: int = 100
    max_seq_length: int = 2048
    grad_checkpoint: bool = False
    lr_schedule: dict[str, Any] | None = None  # mlx_lm.lora's YAML
    lora_parameters: dict[str, Any] = field(default_factory=lambda: {"rank": 8, "dropout": 0.0, "scale": 20.0})
    seed: int = 0
    trust_remote_code: bool = False
    # The pipeline's own.
    micro_batches: int = 1
    schedule: str = "1f1b"

    @classmethod
    def build(cls, flags: dict[str, Any], config_file: Path | None = None) -> TrainOptions:
        """Command-line flags (None: not given) over the ``-c`` YAML file over mlx_lm.lora's defaults."""
        values = {k: v for k, v in flags.items() if v is not None}
        if config_file is not None:
            for k, v in read_config(config_file).items():
                values.setdefault(k, v)
        options = cls(**values)
        options.check()
        return options

    def check(self) -> None:
        """Raise UsageError naming the flag whose value cannot work."""
        positive = ("batch_size", "iters", "steps_per_report", "steps_per_eval", "save_every", "max_seq_length",
                    "micro_batches")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise UsageError(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"--schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.batch_size % self.micro_batches:
            raise UsageError(
                f"--batch-size {self.batch_size} is not a multiple of --micro-batches {self.micro_batches}",
                hint="each micro-batch gets the same number of sequences",
            )
        if self.fine_tune_type not in FINE_TUNE_TYPES:
            raise UsageError(f"--fine-tune-type {self.fine_tune_type!r}: mlxpipe trains lora or dora adapters")
        one_of(self.optimizer.lower(), OPTIMIZERS, "--optimizer")
        if not self.train and not self.test:
            raise UsageError("give --train (and/or --test)", "mlxpipe lora --model M --train --data DIR")
        if self.test and not self.train and self.resume_adapter_file is None:
            raise UsageError("--test alone needs --resume-adapter-file with the adapters to test")
        if "scale" not in self.lora_parameters or "rank" not in self.lora_parameters:
            raise UsageError("lora_parameters needs 'rank' and 'scale' (mlx-lm's names; 'alpha' is not one)")
        self.lora_parameters.setdefault("dropout", 0.0)
        if self.lora_parameters.get("dropout"):
            raise UsageError("lora_parameters dropout > 0 is not supported across ranks yet", hint="use dropout 0")
        if self.resume_adapter_file is not None and not Path(self.resume_adapter_file).is_file():
            raise UsageError(f"--resume-adapter-file {self.resume_adapter_file}: no such file")

    def for_ranks(self) -> TrainSpec:
        """What every rank needs to add its adapters and build its optimizer (JobSpec.train): the chosen
        optimizer's own config, as mlx_lm.lora picks it."""
        optimizer = self.optimizer.lower()
        return TrainSpec(seed=int(self.seed), num_layers=int(self.num_layers), lora_parameters=self.lora_parameters,
                         fine_tune_type=self.fine_tune_type, optimizer=optimizer,
                         optimizer_config=(self.optimizer_config or {}).get(optimizer, {}) or {},
                         learning_rate=float(self.learning_rate), lr_schedule=self.lr_schedule,
                         grad_checkpoint=self.grad_checkpoint)

    def mlx_lm_args(self) -> types.SimpleNamespace:
        """The ``args`` mlx-lm's tuner functions read (``load_dataset``)."""
        return types.SimpleNamespace(**asdict(self))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_config(path: Path) -> dict[str, Any]:
    """mlx_lm.lora's ``-c`` YAML file (with its float resolver), keys checked."""
    import yaml
    from mlx_lm.lora import yaml_loader

    try:
        data = yaml.load(path.read_text(), yaml_loader)
    except OSError as e:
        raise ConfigError(f"-c {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"-c {path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"-c {path}: expected a mapping of options")
    known = {f.name for f in fields(TrainOptions)}
    ignored = {"config", "report_to", "project_name", "clear_cache_threshold", "grad_accumulation_steps"}
    unknown = sorted(set(data) - known - ignored)
    if unknown:
        raise ConfigError(f"-c {path}: unknown option {unknown[0]!r}", hint=f"known: {', '.join(sorted(known))}")
    if data.get("grad_accumulation_steps", 1) not in (None, 1):
        raise ConfigError(f"-c {path}: grad_accumulation_steps is not supported", hint="use --micro-batches")
    return {k: v for k, v in data.items() if k in known}


# --- data: exactly mlx_lm.lora's batches ------------------------------------------------------


@dataclass
class Datasets:
    train: Any
    valid: Any
    test: Any


def load_datasets(options: TrainOptions, model_dir: Path) -> Datasets:
    """mlx-lm's ``load_dataset`` with the model's tokenizer, wrapped as mlx_lm.lora wraps them."""
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir, {"trust_remote_code": options.trust_remote_code})
    try:
        train, valid, test = load_dataset(options.mlx_lm_args(), tokenizer)
    except ValueError as e:
        raise UsageError(f"--data {options.data}: {e}") from e
    return Datasets(CacheDataset(train), CacheDataset(valid), CacheDataset(test))


def longest_sequence(dataset: Any) -> int:
    """The longest tokenized sequence of ``dataset`` (mlx-lm caches the tokenization for the batches)."""
    longest = 0
    for i in range(len(dataset)):
        item = dataset[i]
        tokens = item[0] if isinstance(item, tuple) else item
        longest = max(longest, len(tokens))
    return longest


def _wire(batch: tuple[mx.array, mx.array]) -> tuple[list[list[int]], list[list[int]]]:
    tokens, lengths = batch
    return cast(list[list[int]], tokens.tolist()), cast(list[list[int]], lengths.tolist())


def eval_batches(
    dataset: Any, options: TrainOptions, num_batches: int
) -> list[tuple[list[list[int]], list[list[int]]]]:
    """The batches mlx-lm's ``evaluate`` takes, drawn the same way (one permutation, when any batch is taken)."""
    from mlx_lm.tuner.trainer import iterate_batches

    index = iter(range(num_batches)) if num_batches != -1 else iter(int, 1)
    batches = iterate_batches(dataset=dataset, batch_size=options.batch_size, max_seq_length=options.max_seq_length)
    return [_wire(b) for _, b in zip(index, batches, strict=False)]


def requests(options: TrainOptions, data: Datasets, resume: bytes | None) -> Iterator[TrainMessage]:
    """Every message of the run, numbered, in mlx_lm.lora's order of events (so numpy's draws come in the same
    order)."""
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    ids = itertools.count(1)
    np.random.seed(options.seed)
    if resume is not None:
        yield Resume(id=next(ids), data=base64.b64encode(resume).decode())
    if options.train:
        train = iterate_batches(dataset=data.train, batch_size=options.batch_size,
                                max_seq_length=options.max_seq_length, loop=True)
        for it, batch in zip(range(1, options.iters + 1), train, strict=False):
            if len(data.valid) and (it == 1 or it % options.steps_per_eval == 0 or it == options.iters):
                yield Eval(id=next(ids), it=it, what="val",
                           batches=eval_batches(data.valid, options, options.val_batches))
            tokens, lengths = _wire(batch)
            yield Step(id=next(ids), it=it, batch=tokens, lengths=lengths, micro_batches=options.micro_batches,
                       schedule=options.schedule)
            if it % options.save_every == 0:
                yield Save(id=next(ids), it=it, checkpoint=True)
        yield Save(id=next(ids), it=options.iters, checkpoint=False)
    if options.test:
        yield Eval(id=next(ids), it=None, what="test", batches=eval_batches(data.test, options, options.test_batches))


# --- the run ----------------------------------------------------------------------------------


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


def write_adapter_config(options: TrainOptions, model_path: str) -> Path:
    """``adapter_config.json`` as mlx_lm.lora writes it (its keys, sorted), plus the pipeline's options."""
    from mlx_lm.utils import save_config

    path = Path(options.adapter_path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**asdict(options), "model": model_path, "config": None, "report_to": None, "project_name": None,
              "grad_accumulation_steps": 1, "clear_cache_threshold": 0}
    save_config(config, path / CONFIG_FILE)
    return path / CONFIG_FILE


def merge_adapters(parts: dict[int, str]) -> dict[str, Any]:
    """Every rank's adapter tensors (as its ``adapter`` event carries them) in one dict, the first layers first."""
    from mlxpipe.worker.training.train import decode_weights

    merged: dict[str, Any] = {}
    for rank in sorted(parts, reverse=True):  # the highest rank runs the first layers
        merged.update(decode_weights(parts[rank]))
    return merged


def save_adapters(weights: dict[str, Any], path: Path) -> None:
    """``weights`` as one safetensors file, written whole (a crash leaves the old one)."""
    import mlx.core as mx

    with replacing(path, suffix=".tmp.safetensors") as tmp:
        mx.save_safetensors(str(tmp), weights)


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

