"""A model's list of blocks, and whether the generic pipeline can cut it."""

from __future__ import annotations

from typing import TypeGuard

import mlx.nn as nn

from mlxpipe.errors import ModelError

# Architectures the generic pipeline cannot cut: what their layers hand each
# other is not arrays the size of the hidden state (a shared dict of growing
# state, residual-block objects, fused norms of the next rank's layer), or the
# model runs the stack in another way than once, block by block.
UNSUPPORTED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v41": "its layers hand compressed-KV state to later layers through a shared dict",
    "iquestloopcoder": "its model runs each block's attention itself, twice, instead of calling the blocks",
    "kimi_k3": "its layers pass an attention-residual object, not arrays, to the next layer",
    "muse_spark": "each block norms the next block's input with that block's weights, which the next rank holds",
    "nanbeige": "it runs the layer stack several times",
}


def find_layers(model: nn.Module) -> tuple[nn.Module, str]:
    """The module and attribute name holding the model's list of blocks.

    Prefers the list ``model.layers`` names (the list mlx-lm builds caches
    for), else the shallowest attribute called ``layers`` holding modules.
    """
    target = getattr(model, "layers", None)
    candidates = sorted(model.named_modules(), key=lambda item: item[0].count("."))
    for _, module in candidates:
        for key, value in module.items():
            if _is_layer_list(value) and _same_layers(value, target):
                return module, key
    if target is None:
        for _, module in candidates:
            value = module.get("layers")
            if _is_layer_list(value):
                return module, "layers"
    raise ModelError(
        f"{type(model).__module__} keeps no list of layers the pipeline can split",
        hint="this architecture cannot be pipelined by mlxpipe",
    )


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in the order it runs them.

    The list ``find_layers`` finds; else what ``model.layers`` returns, when
    that joins several lists (AFM's blocks, then its KV-reuse blocks): the
    pipeline wraps the block objects themselves, wherever they are kept.
    """
    try:
        owner, key = find_layers(model)
    except ModelError:
        joined = getattr(model, "layers", None)
        if _is_layer_list(joined):
            return joined
        raise
    layers: list[nn.Module] = owner[key]
    return layers


def _is_layer_list(value: object) -> TypeGuard[list[nn.Module]]:
    """Whether ``value`` is a non-empty list of modules."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, nn.Module) for v in value)
    )


def _same_layers(value: list[nn.Module], target: object) -> bool:
    """Whether ``value`` holds the same layer objects as ``target``."""
    if target is None:
        return False
    if value is target:
        return True
    # ``layers`` properties may return a fresh slice of the list.
    return isinstance(target, list) and len(value) == len(target) and all(
        a is b for a, b in zip(value, target, strict=True)
    )


def model_type_of(model: nn.Module) -> str:
    """The mlx-lm module name of the architecture (``qwen2``, ``llama``...)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def check_supported(model: nn.Module) -> None:
    """Raise ModelError when the generic pipeline cannot split ``model``."""
    reason = UNSUPPORTED_MODEL_TYPES.get(model_type_of(model))
    if reason is not None:
        native = has_native_pipeline(model)
        raise ModelError(
            f"mlxpipe cannot pipeline {model_type_of(model)}: {reason}",
            hint="run it with --pipeline native (mlx-lm's own pipeline for it; one request at a time)"
            if native else "run it on one machine with mlx_lm.generate",
        )
    blocks_of(model)


def has_native_pipeline(model: nn.Module) -> bool:
    """Whether mlx-lm's own ``pipeline()`` exists for this model."""
    inner = model.get("model")
    return isinstance(inner, nn.Module) and callable(getattr(inner, "pipeline", None))
