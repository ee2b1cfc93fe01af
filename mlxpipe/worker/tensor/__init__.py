"""Tensor parallelism: one stage's layers sliced across the members of its group (``--tp``).

``shard_model`` runs on the lazily loaded model, before the pipeline cuts it
(the slices of layers this stage does not run are never evaluated):

* the blocks: the model's own ``shard(group)`` where mlx-lm has one, else the
  generic sharder of ``blocks`` (attention split by heads, MLPs split, fused
  projections by their real layout; MoE experts in ``experts``, latent
  attention in ``mla``, norms over all heads in ``norms``; anything else
  refused in one line, and a few models by name, ``REFUSED_MODEL_TYPES``);
* ``check_shardable`` runs the same on a model built without weights, so the
  controller refuses before launching what the ranks would refuse;
* in a pipeline of several stages, the row-parallel layers' reduction is the
  stage's own (``reduce``): MLX's ring cannot split the world group;
* the vocabulary head and the embedding, split by vocabulary (``vocab``): exact
  (a gather, and a sum in which one member alone is non-zero); plain or
  quantized. Once the pipeline is cut, ``follow_exchange`` tells the head when
  stages other than 0 read its logits.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.stages.layers import blocks_of, model_type_of
from mlxpipe.worker.tensor.blocks import shard_block
from mlxpipe.worker.tensor.reduce import group_reductions, hand_world_to, stray_group_users
from mlxpipe.worker.tensor.vocab import shard_vocab

# Models whose code the sharder cannot see into, refused by name: what they do that a split would break.
REFUSED_MODEL_TYPES = {
    "exaone": "its attention reshapes its output to the whole hidden size, which a split by heads halves",
    "plamo": "its query heads read the KV heads tiled (head i reads KV head i modulo their count), which a "
             "split into consecutive heads breaks",
    "bailing_moe_linear": "its linear-attention layers keep per-head decay rates for all heads",
    "seed_oss": "its tied head reads embed_tokens.weight itself, of which the vocabulary split leaves a part",
}


def has_own_shard(model: nn.Module) -> bool:
    """Whether mlx-lm's class for this model has its own ``shard()``."""
    return callable(getattr(type(model), "shard", None))


class _Shapes:
    """A stand-in MLX group for checks before launch: its size and rank are all that slicing a lazily
    built model's weights reads (no collective ever runs on it)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def check_shardable(model: nn.Module, tp: int, stages: int = 1) -> str:
    """Slice a model built without weights as a rank of ``stages`` groups of ``tp`` would; ModelError
    where the ranks would refuse (cheap: nothing is computed). Returns how it shards."""
    try:
        # Slicing reads only size() and rank() of the world: no collective runs on the stand-in.
        return shard_model(model, Topology(cast(mx.distributed.Group, _Shapes(tp * stages)), tp))
    except (ValueError, KeyError, IndexError) as e:  # a layout the sharder misread: refuse, never crash
        raise ModelError(f"{model_type_of(model)}: the tensor-parallel sharder cannot split it ({e})",
                         hint="run it without --tp (a pipeline)") from e


def shard_model(model: nn.Module, topology: Topology) -> str:
    """Slice ``model`` in place for this rank's tensor group; returns how (``own shard()`` or ``generic``)."""
    if not topology.sharded:
        return "none"
    tensor = topology.tensor
    model_type = model_type_of(model)
    if model_type in REFUSED_MODEL_TYPES:
        raise ModelError(f"{model_type}: {REFUSED_MODEL_TYPES[model_type]}", hint="run it without --tp (a pipeline)")
    # The group reduces by its own exchanges (a stage of a pipeline, or 2 members); else pure tensor
    # parallelism of more: the world is the group, and MLX's own collectives reduce.
    group = tensor if tensor.exchanges else topology.world
    how = "generic"
    if has_own_shard(model):
        model.shard(group)
        how = "own shard()"
    else:
        for index, block in enumerate(blocks_of(model)):
            shard_block(block, group, f"{model_type_of(model)} layer {index}")
    if tensor.exchanges:
        group_reductions(model, tensor)
        stray = stray_group_users(model, tensor)
        if stray and tensor.whole_world:
            hand_world_to(model, tensor, topology.world)  # their mx.distributed calls get the world group
        elif stray:
            raise ModelError(
                f"{model_type_of(model)}'s own shard() reduces in {stray[0]} over an MLX group, "
                "which a tensor group inside a pipeline does not have on the ring backend",
                hint="run it with --tp equal to the number of hosts (pure tensor parallelism)",
            )
    shard_vocab(model, tensor)
    return how
