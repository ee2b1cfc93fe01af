"""worker/tensor/norms.py: a norm over all heads, split with the heads, divides by the whole width's mean."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.worker.groups import single_topology
from mlxpipe.worker.tensor.norms import GroupRMSNorm, split_norm

WIDTH = 16


class _Mirrored:
    """Member ``r`` of a group of 2 whose other member holds the same entries: the group's sum is twice its own."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank

    def all_sum(self, x: mx.array) -> mx.array:
        return 2 * x


def _norm() -> nn.RMSNorm:
    norm = nn.RMSNorm(WIDTH, eps=1e-5)
    norm.weight = mx.arange(1, WIDTH + 1, dtype=mx.float32) / WIDTH  # each entry its own weight
    return norm


def test_each_member_keeps_its_slice_of_the_weight_and_the_whole_widths_mean() -> None:
    whole = _norm()
    half = mx.random.normal((2, 3, WIDTH // 2))
    expected = whole(mx.concatenate([half, half], axis=-1))  # what one process computes over every head
    members = [GroupRMSNorm(whole, _Mirrored(r)) for r in (0, 1)]
    assert [m.weight.tolist() for m in members] == [whole.weight[:8].tolist(), whole.weight[8:].tolist()]
    joined = mx.concatenate([m(half) for m in members], axis=-1)
    assert mx.allclose(joined, expected, atol=1e-6).item()


def test_a_group_of_one_is_the_norm_itself() -> None:
    whole = _norm()
    x = mx.random.normal((1, 4, WIDTH))
    assert mx.allclose(GroupRMSNorm(whole, single_topology().tensor)(x), whole(x), atol=1e-6).item()


def test_only_an_rms_norm_over_the_whole_width_is_split() -> None:
    block = nn.Module()
    block.q_norm, block.k_norm, block.other = _norm(), nn.RMSNorm(8), nn.LayerNorm(WIDTH)
    assert split_norm(block, "q_norm", WIDTH, _Mirrored(0)) and type(block.q_norm) is GroupRMSNorm
    assert not split_norm(block, "k_norm", WIDTH, _Mirrored(0))  # per-head width: nothing to split
    assert not split_norm(block, "other", WIDTH, _Mirrored(0))  # another kind of norm
    assert not split_norm(block, "absent", WIDTH, _Mirrored(0))
