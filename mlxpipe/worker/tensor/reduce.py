"""The row-parallel layers' reduction over a tensor group's own exchanges (a stage of a pipeline, or 2 hosts).

mlx's ``ShardedToAllLinear`` sums its partial outputs with
``mx.distributed.all_sum`` over an MLX group; inside a pipeline the group is
one stage's members, which the ring backend cannot split off the world, and a
group of 2 sums faster by one swap of messages than by MLX's ring ``all_sum``
(see ``worker.groups``). The layers keep their class's behaviour with the
group's neighbour exchange (``TensorGroup.all_sum``) as the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear

from mlxpipe.worker.groups import SliceGroup, TensorGroup


class GroupShardedToAllLinear(ShardedToAllLinear):
    """``ShardedToAllLinear`` summed over its ``TensorGroup`` (its ``group``)."""

    group: TensorGroup  # type: ignore[assignment]  # mlx read its size() and rank() to slice; it sums here

    def __call__(self, x: mx.array) -> mx.array:
        x = self.group.all_sum(x @ self["weight"].T)
        return x + self["bias"] if "bias" in self else x


class GroupQuantizedShardedToAllLinear(QuantizedShardedToAllLinear):
    """``QuantizedShardedToAllLinear`` summed over its ``TensorGroup`` (its ``group``)."""

    group: TensorGroup  # type: ignore[assignment]  # as above

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.quantized_matmul(
            x, self["weight"], scales=self["scales"], biases=self.get("biases"), transpose=True,
            group_size=self.group_size, bits=self.bits, mode=getattr(self, "mode", "affine"),
        )
        x = self.group.all_sum(x)
        return x + self["bias"] if "bias" in self else x


_REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {ShardedToAllLinear: GroupShardedToAllLinear,
                 QuantizedShardedToAllLinear: GroupQuantizedShardedToAllLinear}


def group_reductions(model: nn.Module, tensor: TensorGroup) -> None:
    """Make every row-parallel layer of ``model`` sliced for ``tensor`` sum over it."""
    for _, module in model.named_modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None and getattr(module, "group", None) is tensor:
            module.__class__ = replacement


def stray_group_users(model: nn.Module, tensor: TensorGroup) -> list[str]:
    """Modules other than sharded linears that hold ``tensor`` as an MLX group (an MoE block's
    ``sharding_group``, say): they would hand it to ``mx.distributed`` itself."""
    stray = []
    for name, module in model.named_modules():
        if type(module).__module__.startswith("mlx.nn.layers.distributed") or isinstance(
            module, (GroupShardedToAllLinear, GroupQuantizedShardedToAllLinear)
        ):
            continue
        if any(value is tensor for value in vars(module).values()) or any(
            module.get(k) is tensor for k in module
        ):
            stray.append(name or "the model")
    return stray


def hand_world_to(model: nn.Module, tensor: TensorGroup, world: mx.distributed.Group) -> None:
    """Pure tensor parallelism: the modules ``stray_group_users`` finds hold the world group instead of
    ``tensor`` (the same members, sizes and ranks), for their own ``mx.distributed`` calls."""
    for _, module in model.named_modules():
        if isinstance(module, (GroupShardedToAllLinear, GroupQuantizedShardedToAllLinear)):
            continue
        for key, value in list(vars(module).items()):
            if value is tensor:
                setattr(module, key, world)
        for key in list(module.keys()):
            if module.get(key) is tensor:
                module[key] = world


def reducer(group: SliceGroup) -> Callable[[mx.array], mx.array]:
    """The sum across ``group`` for layers mlxpipe slices itself (MoE blocks, norms over all heads): a stage's
    ``TensorGroup`` sums by itself (neighbour exchanges); an MLX group (the world, with pure tensor parallelism
    over more than 2 hosts) by ``all_sum``."""
    own = getattr(group, "all_sum", None)
    return own if callable(own) else partial(mx.distributed.all_sum, group=group)
