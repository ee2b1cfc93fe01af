"""The job a rank runs: which model files, which layers, which pipeline.

The controller builds one ``JobSpec`` for the whole run and passes it to
every rank on the command line (``--job <base64 JSON>``); each rank picks its
own entries by rank.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass, fields

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import DEFAULT_NUM_DRAFT_TOKENS

MODES = ("generic", "native")


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
    prefill_step_size: int = 2048
    max_kv_size: int | None = None
    # LoRA fine-tuning instead of serving requests (``mlxpipe lora``): mlx_lm.lora's
    # options as ``mlxpipe.lora.run.TrainOptions.for_ranks`` writes them.
    train: dict | None = None
    adapter_path: str | None = None  # LoRA adapters (mlx-lm's adapter_config.json + adapters.safetensors)
    # Speculative decoding (mlx_lm.generate's --draft-model): every rank loads this whole model,
    # from its own host's copy (rank r: draft_paths[r]).
    draft_paths: list[str] | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    tp: int = 1  # ranks per tensor-parallel group (one pipeline stage each)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise UsageError(f"tp must be at least 1, got {self.tp}")
        if len(self.model_paths) != len(self.split) * self.tp:
            raise UsageError(
                f"job has {len(self.model_paths)} model paths for {len(self.split)} stages of {self.tp} ranks"
                if self.tp > 1 else f"job has {len(self.model_paths)} model paths for {len(self.split)} ranks"
            )
        if self.tp > 1 and self.mode != "generic":
            raise UsageError("tensor parallelism (--tp) runs with the generic pipeline only",
                             hint="run without --pipeline native")
        if self.tp > 1 and self.train is not None:
            raise UsageError("LoRA training does not run with --tp yet", hint="train without --tp (a pipeline)")
        if not self.split or any(n <= 0 for n in self.split):
            raise UsageError(f"every rank needs at least one layer, got split {self.split}")
        if self.mode not in MODES:
            raise UsageError(f"unknown pipeline mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.prefill_step_size <= 0:
            raise UsageError("prefill_step_size must be positive")
        if self.num_draft_tokens < 1:
            raise UsageError(f"num_draft_tokens must be at least 1, got {self.num_draft_tokens}")
        if self.draft_paths is not None and len(self.draft_paths) != self.world_size:
            raise UsageError(f"job has {len(self.draft_paths)} draft model paths for {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        """The number of ranks the job runs on."""
        return len(self.model_paths)

    def layer_range(self, rank: int) -> tuple[int, int]:
        """The layers ``[start, end)`` that ``rank`` runs (its stage's, with ``tp`` > 1)."""
        return layer_range(self.split, rank // self.tp)

    def encode(self) -> str:
        """The job as URL-safe base64 JSON, safe on a shell command line."""
        return base64.urlsafe_b64encode(json.dumps(asdict(self)).encode()).decode()

    @classmethod
    def decode(cls, text: str) -> "JobSpec":
        """Parse ``encode()``'s output."""
        try:
            data = json.loads(base64.urlsafe_b64decode(text.encode()))
        except (binascii.Error, ValueError) as e:
            raise UsageError(f"the --job argument is not a base64 JSON job: {e}") from e
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            # A controller newer than this worker; refuse rather than ignore.
            raise UsageError(
                f"the job has fields this worker does not know: {', '.join(unknown)}",
                hint="install the same mlxpipe version on every host",
            )
        return cls(**data)


def layer_range(split: list[int], stage: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of pipeline ``stage`` (a rank, with tp = 1): stages above it run the
    earlier layers."""
    start = sum(split[stage + 1 :])
    return start, start + split[stage]
