"""Cutting a model for this rank: mlxpipe's generic pipeline or mlx-lm's native one, and what crosses each cut."""

from __future__ import annotations

import json
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxpipe.errors import ModelError
from mlxpipe.protocol.job import layer_range
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.stages.layers import blocks_of, check_supported, has_native_pipeline, model_type_of
from mlxpipe.worker.stages.layout import _HEADER_BYTES, _PROBE_TOKENS
from mlxpipe.worker.stages.stage import Exchange, _Stage, _stage_class


def check_split(split: list[int], num_layers: int, group_size: int) -> None:
    """Raise ModelError unless ``split`` covers ``num_layers`` over the group."""
    if len(split) != group_size:
        raise ModelError(f"split {split} has {len(split)} entries for {group_size} ranks")
    if sum(split) != num_layers or any(n <= 0 for n in split):
        raise ModelError(
            f"split {split} must be positive and sum to the model's {num_layers} layers"
        )


def pipeline_generic(model: nn.Module, where: Topology | mx.distributed.Group, split: list[int]) -> tuple[int, int]:
    """Pipeline ``model`` in place for this rank's stage; returns its ``[start, end)``.

    ``where`` is the rank's ``Topology`` (or, for a plain pipeline, its group).
    """
    topology = where if isinstance(where, Topology) else Topology(where, 1)
    check_supported(model)
    layers = blocks_of(model)
    rank, size = topology.stage, topology.stages
    check_split(split, len(layers), size)
    start, end = layer_range(split, rank)
    if size == 1:
        return start, end
    exchange = Exchange()
    for i, layer in enumerate(layers):
        stage = _Stage(
            topology=topology,
            index=i,
            local=start <= i < end,
            before_local=i < start,
            receives=i == start and rank < size - 1,
            sends=i == end - 1 and rank > 0,
            gather=i == len(layers) - 1,
            exchange=exchange,
        )
        if not stage.local:
            strip_weights(layer)
        # Every block is wrapped, inner local ones too: each records its output,
        # by which the next block's hidden state is recognised.
        layer.__class__ = _stage_class(type(layer))
        layer._mlxpipe_stage = stage
    return start, end


def find_exchange(model: nn.Module) -> Exchange | None:
    """The ``Exchange`` of a model ``pipeline_generic`` wrapped; None for one rank or native mode."""
    for layer in blocks_of(model):
        stage: _Stage | None = getattr(layer, "_mlxpipe_stage", None)
        if stage is not None:
            return stage.exchange
    return None


def strip_weights(layer: nn.Module) -> None:
    """Remove the parameters of ``layer`` and its submodules, keep the rest."""
    for _, module in layer.named_modules():
        for key in list(module.keys()):
            if key.startswith("_"):
                continue  # private arrays (rope tables...) are not weights
            leaves = _leaves(module[key])
            if any(isinstance(v, mx.array) for v in leaves) and not any(
                isinstance(v, nn.Module) for v in leaves
            ):
                del module[key]


def _leaves(value: Any) -> list[Any]:
    """The leaves of ``value``, stopping at modules."""
    if isinstance(value, nn.Module):
        return [value]
    # tree_flatten returns a list unless given a dict to fill (its annotation says either).
    flat = cast(list[tuple[str, Any]], tree_flatten(value, is_leaf=lambda v: isinstance(v, nn.Module)))
    return [v for _, v in flat]


def pipeline_native(model: nn.Module, group: mx.distributed.Group, split: list[int]) -> tuple[int, int]:
    """Pipeline ``model`` with mlx-lm's own ``model.model.pipeline``."""
    if not has_native_pipeline(model):
        raise ModelError(
            f"{model_type_of(model)} has no native mlx-lm pipeline",
            hint="use the generic pipeline mode",
        )
    inner = model["model"]
    check_split(split, len(inner.layers), group.size())
    inner.pipeline(group, split)
    return inner.start_idx, inner.end_idx


def learn_layouts(model: nn.Module, where: Topology | mx.distributed.Group) -> None:
    """Learn, once at load, what crosses each cut besides the hidden state.

    Stage by stage from the first: a stage hears from stage + 1 what it will
    receive, runs its layers lazily on a few tokens (nothing is evaluated) to
    see what its last layer returns, and tells stage - 1. ``where``: the rank's
    ``Topology`` (or its group, for a plain pipeline).
    """
    from mlx_lm.models.cache import make_prompt_cache

    exchange = find_exchange(model)
    if exchange is None:
        return
    topology = where if isinstance(where, Topology) else Topology(where, 1)
    rank, size = topology.stage, topology.stages
    if rank < size - 1:
        header = topology.recv_up((_HEADER_BYTES,), mx.uint8, stream=mx.cpu)
        try:
            exchange.incoming_layout = json.loads(bytes(np.array(header)).rstrip(b"\0") or b"null")
        except ValueError:  # UnicodeDecodeError included: the ring hands over what it got
            # A peer that died before sending leaves garbage here: a consequence, not the root cause.
            raise RuntimeError(f"no layout from stage {rank + 1}: connection to a peer was lost") from None
    exchange.probing = True
    try:
        model(mx.zeros((1, _PROBE_TOKENS), mx.int32), cache=make_prompt_cache(model))
    finally:
        exchange.probing = False
        exchange.last_out = exchange.last_extras = None
    if rank > 0:
        text = json.dumps(exchange.outgoing_layout).encode()
        if len(text) > _HEADER_BYTES:
            raise ModelError("the blocks of this model return too many arrays to pipeline")
        data = mx.array(np.frombuffer(text.ljust(_HEADER_BYTES, b"\0"), dtype=np.uint8))
        mx.eval(topology.send_down(data, stream=mx.cpu))
