"""A training rank's LoRA parameters, optimizer and gradient checkpointing, made with mlx-lm's tuner exactly as
single-process mlx_lm.lora makes them."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers
from mlx_lm.utils import _get_classes

from mlxpipe.errors import UsageError
from mlxpipe.protocol.job import TrainSpec
from mlxpipe.worker.load import flat_parameters
from mlxpipe.worker.stages.layers import find_layers

# By the names TrainSpec takes (protocol.job.OPTIMIZERS).
OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
              "adafactor": optim.Adafactor}


def add_lora(model: nn.Module, config: dict[str, Any], options: TrainSpec) -> None:
    """Give this rank's layers the LoRA parameters single-process mlx_lm.lora would give them.

    mlx_lm.lora seeds, then converts the last ``num_layers`` layers in order; every
    random draw depends on the draws before it. So the conversion runs first on a
    weightless copy of the whole model (lazy, never evaluated but for this rank's
    part), then this rank's own layers are converted and take the copy's values.
    """
    num_layers, params = options.num_layers, options.lora_parameters
    use_dora = options.fine_tune_type == "dora"
    model_class, args_class = _get_classes(config)
    whole = model_class(args_class.from_dict(config))
    mx.random.seed(options.seed)
    whole.freeze()
    if num_layers > len(whole.layers):
        raise UsageError(
            f"--num-layers {num_layers}: the model has only {len(whole.layers)} layers"
        )
    linear_to_lora_layers(whole, num_layers, params, use_dora=use_dora)
    reference = dict(flat_parameters(whole.trainable_parameters()))

    model.freeze()
    owner, key = find_layers(model)
    layers = owner[key]
    trained = layers[-max(num_layers, 0):]  # as mlx-lm slices: 0 and -1 both mean every layer
    local = [layer for layer in trained if not _is_stand_in(layer)]
    if local:
        linear_to_lora_layers(_Layers(local), len(local), params, use_dora=use_dora)
    # DoRA's magnitudes come from the real weights; only the random A and zero B are copied.
    copied = [(name, reference[name]) for name, _ in flat_parameters(model.trainable_parameters())
              if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")]
    model.load_weights(copied, strict=False)
    mx.eval(model.parameters())


class _Layers(nn.Module):
    """A view holding only some layers, for ``linear_to_lora_layers``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        self.layers = layers


def _is_stand_in(layer: nn.Module) -> bool:
    stage = getattr(layer, "_mlxpipe_stage", None)
    return stage is not None and not stage.local


def checkpoint_layers(model: nn.Module) -> None:
    """``--grad-checkpoint``: mlx-lm's checkpointing, on the layer class behind the pipeline's wrapper."""
    from mlx_lm.tuner.trainer import grad_checkpoint

    owner, key = find_layers(model)
    layer = next(layer for layer in owner[key] if not _is_stand_in(layer))
    base: type[nn.Module] = type(layer)
    if getattr(layer, "_mlxpipe_stage", None) is not None:
        base = type(layer).__mro__[2]  # Pipelined<cls> -> _PipelineStage -> cls
    grad_checkpoint(base.__new__(base))  # it reads only type(layer); no constructor needed


def build_optimizer(options: TrainSpec) -> optim.Optimizer:
    """The optimizer exactly as mlx_lm.lora builds it (``TrainSpec`` checked its name)."""
    schedule = options.lr_schedule
    lr = build_schedule(schedule) if schedule else options.learning_rate
    optimizer: optim.Optimizer = OPTIMIZERS[options.optimizer](learning_rate=lr, **options.optimizer_config)
    return optimizer
