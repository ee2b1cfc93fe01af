"""Tensor parallelism: one stage's layers sliced across the members of its group (``--tp``).

``shard_model`` runs on the lazily loaded model, before the pipeline cuts it
(the slices of layers this stage does not run are never evaluated):

* the blocks: the model's own ``shard(group)`` where mlx-lm has one, else the
  generic sharder of ``blocks`` (attention split by heads, MLPs split, fused
  projections by their real layout; anything else refused in one line);
* in a pipeline of several stages, the row-parallel layers' reduction is the
  stage's own (``reduce``): MLX's ring cannot split the world group;
* the vocabulary head and the embedding, split by vocabulary (``vocab``): exact
  (a gather, and a sum in which one member alone is non-zero); plain or
  quantized. Once the pipeline is cut, ``follow_exchange`` tells the head when
  stages other than 0 read its logits.
"""

from __future__ import annotations

import mlx.nn as nn

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.pipeline.layers import blocks_of, model_type_of
from mlxpipe.worker.tensor.blocks import shard_block
from mlxpipe.worker.tensor.reduce import group_reductions, stray_group_users
from mlxpipe.worker.tensor.vocab import shard_vocab


def has_own_shard(model: nn.Module) -> bool:
    """Whether mlx-lm's class for this model has its own ``shard()``."""
    return callable(getattr(type(model), "shard", None))


def shard_model(model: nn.Module, topology: Topology) -> str:
    """Slice ``model`` in place for this rank's tensor group; returns how (``own shard()`` or ``generic``)."""
    if not topology.sharded:
        return "none"
    tensor = topology.tensor
    # Pure tensor parallelism: the world is the group, and MLX's own collectives reduce.
    group = topology.world if tensor.whole_world else tensor
    how = "generic"
    if has_own_shard(model):
        model.shard(group)
        how = "own shard()"
    else:
        for index, block in enumerate(blocks_of(model)):
            shard_block(block, group, f"{model_type_of(model)} layer {index}")
    if not tensor.whole_world:
        group_reductions(model, tensor)
        stray = stray_group_users(model, tensor)
        if stray:
            raise ModelError(
                f"{model_type_of(model)}'s own shard() reduces in {stray[0]} over an MLX group, "
                "which a tensor group inside a pipeline does not have on the ring backend",
                hint="run it with --tp equal to the number of hosts (pure tensor parallelism)",
            )
    shard_vocab(model, tensor)
    return how
