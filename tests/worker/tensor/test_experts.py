"""MoE experts split across a tensor group (``worker/tensor/experts.py``): the members' partial outputs add
up to the whole block's, float32 and quantized, with biases, in one process.

Each member is the same block sliced for its place in a group of 2; the group's
sum is done here by adding the two members' outputs (the ranks' own all-reduce
is run by ``tests/e2e/test_tensor_architectures.py`` and ``tests/e2e/test_tensor_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.qwen2_moe import ModelArgs, Qwen2MoeSparseMoeBlock
from mlx_lm.models.switch_layers import SwitchMLP

from mlxpipe.worker.tensor.blocks import _MLP
from mlxpipe.worker.tensor.experts import ReducedMoE, moe_blocks, shard_moe

HIDDEN, WIDTH, EXPERTS = 64, 128, 4  # widths that halve into whole quantization groups of 32


class _Member:
    """One member's place in a group of 2: the sum across the group is done by the test."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank

    def all_sum(self, x: mx.array) -> mx.array:
        return x


class _BiasedExperts(nn.Module):
    """A router and ``SwitchMLP`` experts with biases (as gpt_oss's), their outputs weighted and added."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = SwitchMLP(HIDDEN, WIDTH, EXPERTS, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        scores = mx.softmax(self.router(x), axis=-1)
        inds = mx.argpartition(-scores, kth=1, axis=-1)[..., :2]
        y = self.experts(x, inds)
        return (y * mx.take_along_axis(scores, inds, axis=-1)[..., None]).sum(axis=-2)


def _qwen2_moe() -> nn.Module:
    args = ModelArgs(model_type="qwen2_moe", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=WIDTH,
                     num_attention_heads=4, num_experts_per_tok=2, num_experts=EXPERTS, moe_intermediate_size=WIDTH,
                     shared_expert_intermediate_size=WIDTH, rms_norm_eps=1e-5, vocab_size=32)
    return Qwen2MoeSparseMoeBlock(args)


BLOCKS: dict[str, Callable[[], nn.Module]] = {"qwen2_moe": _qwen2_moe, "switch_mlp_biased": _BiasedExperts}


def _members(make: Callable[[], nn.Module], quantized: bool) -> tuple[nn.Module, list[nn.Module]]:
    """The whole block and its two members' slices, all from the same weights."""
    blocks = []
    for _ in range(3):
        mx.random.seed(7)
        block = make()
        if quantized:
            nn.quantize(block, group_size=32, bits=8)
        block.update(_biases(block))
        blocks.append(block)
    for rank, member in enumerate(blocks[1:]):
        shard_moe(member, _Member(rank), _MLP, "test", "hint")
    return blocks[0], blocks[1:]


def _biases(block: nn.Module) -> dict[str, Any]:
    """Non-zero biases, the same for every copy: one added by every member would show."""
    from mlx.utils import tree_unflatten

    mx.random.seed(11)
    return tree_unflatten([(k, mx.random.normal(v.shape) * 0.1) for k, v in tree_flatten(block.parameters())
                           if k.endswith(".bias")])


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "8-bit"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_members_partial_outputs_add_up_to_the_whole_block(name: str, quantized: bool) -> None:
    whole, members = _members(BLOCKS[name], quantized)
    x = mx.random.normal((1, 5, HIDDEN), key=mx.random.key(3))
    expected = whole(x)
    got = members[0](x) + members[1](x)
    assert mx.abs(got - expected).max().item() <= 1e-4 * max(1.0, mx.abs(expected).max().item())
    for member in members:
        assert isinstance(member, ReducedMoE) and isinstance(member, type(whole))
        # Each member holds half of every expert; the router stays whole.
        for key, value in tree_flatten(member.parameters()):
            if key.endswith("weight") and ("switch" in key or "experts" in key or "shared_expert." in key):
                assert value.size * 2 == dict(tree_flatten(whole.parameters()))[key].size, key
    router = "gate" if name == "qwen2_moe" else "router"
    assert members[0][router].weight.shape == whole[router].weight.shape


def test_only_member_0_keeps_a_row_parallel_bias() -> None:
    _, members = _members(_BiasedExperts, False)
    assert mx.any(members[0].experts.fc2.bias != 0).item()
    assert not mx.any(members[1].experts.fc2.bias != 0).item()


def test_moe_blocks_are_the_experts_parents() -> None:
    block = _qwen2_moe()
    assert [name for name, _ in moe_blocks(block)] == [""]
    assert moe_blocks(nn.Sequential(nn.Linear(4, 4))) == []


class _UnknownShared(_BiasedExperts):
    """Experts beside a dense part the sharder does not know: its output would be added by every member."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(HIDDEN, HIDDEN)


def test_an_unknown_dense_part_beside_the_experts_is_refused() -> None:
    from mlxpipe.errors import ModelError

    with pytest.raises(ModelError, match=r"layer 3: extra.weight \(64, 64\) in its MoE block is neither an expert"):
        shard_moe(_UnknownShared(), _Member(0), _MLP, "layer 3", "hint")


def test_mlx_vlms_own_switch_layers_are_experts_too() -> None:
    """mlx-vlm's MoE language models (Kimi-VL's) hold its copies of the switch layers: split like mlx-lm's."""
    pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'mlxpipe[vision]'")
    from mlx_vlm.models.switch_layers import SwitchGLU

    block = nn.Module()
    block.switch_mlp = SwitchGLU(HIDDEN, WIDTH, EXPERTS)
    assert [name for name, _ in moe_blocks(block)] == [""]
    shard_moe(block, _Member(1), _MLP, "test", "hint")
    assert block.switch_mlp.down_proj.weight.shape == (EXPERTS, HIDDEN, WIDTH // 2)
