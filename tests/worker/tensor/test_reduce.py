"""worker/tensor/reduce.py: row-parallel layers summed over a stage's own group, in one process.

Each member is the same layer sliced by mlx for its place in a group of 2; the group's sum is done here by
adding the two members' outputs (the ranks' own exchanges run in ``tests/e2e/test_tensor_parallel.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import ShardedToAllLinear

from mlxpipe.worker.tensor.reduce import (
    GroupShardedToAllLinear,
    group_reductions,
    hand_world_to,
    reducer,
    stray_group_users,
)


class _Member:
    """One member's place in a group of 2 whose sum the test does itself."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank

    def all_sum(self, x: mx.array) -> mx.array:
        return x


class _Block(nn.Module):
    def __init__(self, linear: nn.Linear, member: _Member) -> None:
        super().__init__()
        self.down_proj = ShardedToAllLinear.from_linear(linear, group=member)


def test_the_members_partial_outputs_add_up_to_the_whole_layers() -> None:
    whole = nn.Linear(16, 8, bias=True)
    members = [_Member(0), _Member(1)]
    blocks = [_Block(whole, m) for m in members]
    for block, member in zip(blocks, members, strict=True):
        group_reductions(block, member)
        assert type(block.down_proj) is GroupShardedToAllLinear
    x = mx.random.normal((2, 16))
    # Row-parallel: each member reads its half of the input. The bias is added after the sum, on every
    # member: adding the two members' outputs here counts it twice.
    total = blocks[0].down_proj(x[:, :8]) + blocks[1].down_proj(x[:, 8:]) - whole.bias
    assert mx.allclose(total, whole(x), atol=1e-5).item()


def test_only_layers_sliced_for_this_group_are_changed() -> None:
    mine, other = _Member(0), _Member(0)
    block = _Block(nn.Linear(16, 8), other)
    group_reductions(block, mine)
    assert type(block.down_proj) is ShardedToAllLinear


def test_modules_that_would_hand_the_group_to_mlx_are_found_and_given_the_world() -> None:
    member, world = _Member(0), _Member(0)
    model: Any = nn.Module()
    model.moe = nn.Module()
    model.moe.sharding_group = member  # as an MoE block's own shard() keeps it
    model.block = _Block(nn.Linear(16, 8), member)
    group_reductions(model.block, member)
    assert stray_group_users(model, member) == ["moe"]  # the sliced linear is not a stray
    hand_world_to(model, member, world)
    assert model.moe.sharding_group is world and model.block.down_proj.group is member
    assert stray_group_users(model, member) == []


def test_the_sum_is_the_groups_own_else_mlxs_all_sum() -> None:
    member = _Member(1)
    assert reducer(member) == member.all_sum
    world = mx.distributed.init()  # an MLX group: no all_sum of its own
    summed = reducer(world)
    assert isinstance(summed, partial) and summed.func is mx.distributed.all_sum
    assert summed(mx.array([3.0])).tolist() == [3.0]  # a group of one
