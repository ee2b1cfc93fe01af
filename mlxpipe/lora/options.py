"""mlx_lm.lora's options for a pipelined run: the flags over the ``-c`` YAML file over mlx_lm.lora's defaults,
each checked as the options are born (naming its flag), and what every rank is sent of them (``TrainSpec``)."""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mlxpipe.errors import ConfigError, UsageError
from mlxpipe.protocol.checks import one_of
from mlxpipe.protocol.job import FINE_TUNE_TYPES, OPTIMIZERS, TrainSpec
from mlxpipe.worker.training.train_schedule import SCHEDULES


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
