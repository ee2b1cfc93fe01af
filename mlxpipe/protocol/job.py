"""The job a rank runs: which model files, which layers, how they are cut into stages.

The controller's ``PipelineConfig`` builds one ``JobSpec`` for the whole run and passes it to
every rank on the command line (``--job <base64 JSON>``); each rank picks its
own entries by rank.

The wire checks only what a rank needs to run the job it is sent, as its guard against a
controller of another version: every field present and known (``decode``), a shape it can
index (a model path per rank, a split entry per stage, groups of ``tp`` ranks), and nothing
no rank could run (a mode it has no pipeline for, tensor-parallel groups where a rank has
none); a value with a range is held to the one rule it has (``protocol/checks.py``). The
user's flags were checked before, once, where the launch config was born
(``launch/config.py``, naming each flag): a job the controller built never fails here.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass
from typing import Any

from mlxpipe.defaults import MLX_LM_PREFILL_STEP
from mlxpipe.errors import UsageError, WireError
from mlxpipe.protocol.checks import at_least, check_mode, one_of, positive
from mlxpipe.protocol.message import strict_fields
from mlxpipe.protocol.request import DEFAULT_NUM_DRAFT_TOKENS, check_fields

FINE_TUNE_TYPES = ("lora", "dora")  # mlx_lm.lora's --fine-tune-type but full (a rank holds its layers frozen)
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")  # mlx_lm.lora's --optimizer


@dataclass(frozen=True)
class TrainSpec:
    """What a training rank (``mlxpipe lora``) needs to add its LoRA adapters and build its optimizer:
    mlx_lm.lora's options by its names, as ``mlxpipe.lora.options.TrainOptions.for_ranks`` writes them."""

    seed: int
    num_layers: int  # layers fine-tuned, from the last (-1: all)
    lora_parameters: dict[str, Any]  # linear_to_lora_layers' config: rank, scale, dropout...
    fine_tune_type: str  # lora or dora
    optimizer: str  # adam, adamw, muon, sgd or adafactor
    optimizer_config: dict[str, Any]  # that optimizer's own keyword arguments
    learning_rate: float
    lr_schedule: dict[str, Any] | None  # mlx-lm's build_schedule config; None: a constant rate
    grad_checkpoint: bool

    def __post_init__(self) -> None:
        one_of(self.fine_tune_type, FINE_TUNE_TYPES, "fine_tune_type")
        one_of(self.optimizer, OPTIMIZERS, "optimizer")


@dataclass(frozen=True)
class JobSpec:
    """What every rank loads and how the layers are pipelined.

    ``model_paths[r]`` is the directory on rank r's host holding the config,
    the tokenizer and rank r's weight files. ``split[s]`` is the number of
    layers pipeline stage s runs, in rank order as in mlx-lm: stage 0 runs the
    last layers, the highest stage the first. With ``tp`` = 1 a stage is one
    rank; with ``tp`` = T > 1, ranks ``s*T .. s*T+T-1`` form stage s's
    tensor-parallel group (``worker.groups``): ``len(model_paths) == len(split) * tp``.
    """

    model_paths: list[str]
    split: list[int]
    mode: str = "generic"
    trust_remote_code: bool = False
    prefill_step_size: int = MLX_LM_PREFILL_STEP
    max_kv_size: int | None = None
    train: TrainSpec | None = None  # LoRA fine-tuning instead of serving requests (``mlxpipe lora``)
    adapter_path: str | None = None  # LoRA adapters (mlx-lm's adapter_config.json + adapters.safetensors)
    # Speculative decoding (mlx_lm.generate's --draft-model): every rank loads this whole model,
    # from its own host's copy (rank r: draft_paths[r]).
    draft_paths: list[str] | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    tp: int = 1  # ranks per tensor-parallel group (one pipeline stage each)
    # A vision-language model, loaded by mlx-vlm: images in (``worker.vision``). False: the text model alone.
    vision: bool = False

    def __post_init__(self) -> None:
        at_least(self.tp, 1, "tp")
        if len(self.model_paths) != len(self.split) * self.tp:
            raise UsageError(
                f"job has {len(self.model_paths)} model paths for {len(self.split)} stages of {self.tp} ranks"
                if self.tp > 1 else f"job has {len(self.model_paths)} model paths for {len(self.split)} ranks"
            )
        # The native pipeline and training have no tensor-parallel groups: no rank could run these.
        if self.tp > 1 and self.mode != "generic":
            raise UsageError("tensor parallelism (--tp) runs with the generic pipeline only",
                             hint="run without --pipeline native")
        if self.vision and (self.mode != "generic" or self.train is not None or self.draft_paths is not None):
            raise UsageError("a vision-language model runs with the generic pipeline, without a draft model or "
                             "training")
        if self.tp > 1 and self.train is not None:
            raise UsageError("LoRA training does not run with --tp yet", hint="train without --tp (a pipeline)")
        if not self.split or any(n <= 0 for n in self.split):
            raise UsageError(f"every rank needs at least one layer, got split {self.split}")
        check_mode(self.mode, "mode")
        positive(self.prefill_step_size, "prefill_step_size")
        check_fields({"num_draft_tokens": self.num_draft_tokens}, lambda _: "num_draft_tokens")  # Request's range
        if self.draft_paths is not None and len(self.draft_paths) != self.world_size:
            raise UsageError(f"job has {len(self.draft_paths)} draft model paths for {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        """The number of ranks the job runs on."""
        return len(self.model_paths)

    @property
    def stages(self) -> int:
        """The pipeline's stages (a tensor-parallel group each)."""
        return len(self.split)

    def layer_range(self, rank: int) -> tuple[int, int]:
        """The layers ``[start, end)`` that ``rank`` runs (its stage's, with ``tp`` > 1)."""
        return layer_range(self.split, rank // self.tp)

    def encode(self) -> str:
        """The job as URL-safe base64 JSON, safe on a shell command line."""
        return base64.urlsafe_b64encode(json.dumps(asdict(self)).encode()).decode()

    @classmethod
    def decode(cls, text: str) -> JobSpec:
        """Parse ``encode()``'s output; refuses fields this worker does not know (a controller newer than it)
        or lacks."""
        try:
            data = json.loads(base64.urlsafe_b64decode(text.encode()))
        except (binascii.Error, ValueError) as e:
            raise UsageError(f"the --job argument is not a base64 JSON job: {e}") from e
        if not isinstance(data, dict):
            raise WireError("the --job argument is not a JSON object")
        values = strict_fields(cls, data, "the job", "worker")
        if "train" in values and values["train"] is not None:
            values["train"] = TrainSpec(**strict_fields(TrainSpec, values["train"], "the job's train", "worker"))
        return cls(**values)


def layer_range(split: list[int], stage: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of pipeline ``stage`` (a rank, with tp = 1): stages above it run the
    earlier layers."""
    start = sum(split[stage + 1 :])
    return start, start + split[stage]
