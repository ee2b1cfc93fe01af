"""Per-rank training memory of ``mlxpipe lora``, estimated before launch. Pure: metadata and numbers.

For each rank: its frozen weights (the plan's bytes), its LoRA parameters with
their gradients and the optimizer's state, and the activations of the
micro-batches it holds between their forward and backward (1F1B: at most as many
as stages from it to the last; GPipe: all of them), rank 0's logits included,
plus, on a stage that runs backward, its working set: the gradients of one
layer's activations for the micro-batch it is differentiating (about that
layer's activations again). The activation figure is Megatron-LM's per-layer
estimate (34·s·b·h + 5·a·s²·b values). Measured on 2 ranks (bench/bench_lora.py's
model, every schedule and M = 1, 2, 8, one launch each): each rank's peak is
0.95–1.0x this estimate; without the working-set term, the naive schedule
(one micro-batch of the whole batch) peaked at 1.19x.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan

LORA_BYTES = 4  # LoRA parameters are float32 (mlx-lm draws them so)
OPTIMIZER_COPIES = {"adam": 2, "adamw": 2, "sgd": 0, "muon": 1, "adafactor": 1}


class TrainingShape(Protocol):
    """What the estimate reads of a run's options (``lora.options.TrainOptions`` has them): the planner stays below
    the LoRA trainer that imports it."""

    max_seq_length: int
    batch_size: int
    micro_batches: int
    num_layers: int
    lora_parameters: dict[str, Any]
    optimizer: str
    schedule: str


@dataclass(frozen=True)
class RankTrainingMemory:
    rank: int
    frozen_bytes: int
    lora_bytes: int  # parameters, accumulated gradients, optimizer state
    activation_bytes: int
    micro_batches_held: int

    @property
    def total_bytes(self) -> int:
        return self.frozen_bytes + self.lora_bytes + self.activation_bytes


def padded_length(longest: int, max_seq_length: int) -> int:
    """The input length of the longest batch, as mlx-lm's ``iterate_batches`` pads it (less the shifted token)."""
    return min(1 + 32 * math.ceil(longest / 32), max_seq_length) - 1


def lora_parameters_of(meta: ModelMetadata, layer: int, rank: int, keys: list[str] | None) -> int:
    """How many LoRA values ``linear_to_lora_layers`` gives block ``layer`` (``rank`` = the LoRA rank)."""
    prefix = f"{meta.block_prefix}.{layer}."
    bits = int((meta.config.get("quantization") or {}).get("bits", 32))
    total = 0
    for t in meta.tensors:
        if not t.name.startswith(prefix) or not t.name.endswith(".weight") or len(t.shape) < 2:
            continue
        module = t.name[len(prefix):-len(".weight")]
        if keys is not None and module not in keys:
            continue
        if keys is None and re.search(r"(^|\.)(embed|norm|ln)", module):
            continue
        out, inp = t.shape[-2], t.shape[-1]
        if t.dtype in ("U32", "I32") and bits < 32:
            inp = inp * 32 // bits
        experts = t.shape[0] if len(t.shape) == 3 else 1
        total += rank * experts * (inp + out)
    return total


def training_memory(
    meta: ModelMetadata, the_plan: Plan, options: TrainingShape, longest: int
) -> list[RankTrainingMemory]:
    """Every rank's estimate for ``options`` (a ``TrainOptions``) with the data's ``longest`` sequence."""
    config = meta.text_config
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 1))
    vocab = int(config.get("vocab_size", 0))
    act_bytes = 4 if str(config.get("torch_dtype", "float32")) == "float32" else 2
    seq = padded_length(longest, options.max_seq_length)
    rows = options.batch_size // options.micro_batches
    per_layer = seq * rows * hidden * (34 + 5 * heads * seq / max(hidden, 1)) * act_bytes / 2
    num_layers = meta.num_layers
    # mlx-lm: 0 and -1 mean all
    trained_from = 0 if options.num_layers <= 0 else max(num_layers - options.num_layers, 0)
    lora = options.lora_parameters
    keys = lora.get("keys")
    copies = 2 + OPTIMIZER_COPIES.get(options.optimizer, 2)  # parameters, gradients, optimizer state
    stages = len(the_plan.ranks)
    first_trained = min((stages - 1 - r.rank for r in the_plan.ranks if r.end > trained_from), default=stages)
    out = []
    for r in the_plan.ranks:
        stage = stages - 1 - r.rank
        trained = range(max(r.start, trained_from), r.end)
        values = sum(lora_parameters_of(meta, i, int(lora["rank"]), keys) for i in trained)
        if stage < first_trained:
            held = 1  # forward only: one micro-batch at a time, nothing kept
        elif options.schedule == "1f1b":
            held = min(stages - stage, options.micro_batches)
        else:
            held = options.micro_batches
        activations = held * per_layer * (r.end - r.start)
        if stage >= first_trained and r.end > r.start:
            activations += per_layer  # the backward's working set: one layer's, one micro-batch
        if r.rank == 0:
            activations += 3 * rows * seq * vocab * 4  # logits, their softmax and gradient, in float32
        out.append(RankTrainingMemory(r.rank, r.weight_bytes, values * LORA_BYTES * copies, int(activations), held))
    return out
