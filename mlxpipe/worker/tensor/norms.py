"""A query or key norm over all heads at once (OLMo 2/3, OLMoE), split with the heads.

``nn.RMSNorm(n_heads * head_dim)`` on the query projection's whole output
divides every entry by the root mean square of all heads' entries together.
Once the heads are split, each member holds its heads' entries only: it keeps
its slice of the norm's weight and sums its entries' squares, and the group
adds the sums (one more all-reduce of one number per token), so every member
divides by the same mean as one process would.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.worker.groups import SliceGroup
from mlxpipe.worker.tensor.reduce import reducer


class GroupRMSNorm(nn.Module):
    """The member's slice of an ``nn.RMSNorm`` over a width split across a tensor group."""

    def __init__(self, norm: nn.RMSNorm, group: SliceGroup) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module.__init__ is unannotated
        width = norm.weight.shape[-1]
        part = width // group.size()
        self.weight = mx.contiguous(norm.weight[group.rank() * part : (group.rank() + 1) * part])
        self.eps, self.width = norm.eps, width
        # A plain attribute (not a parameter): the group's sum.
        object.__setattr__(self, "tp_reduce", reducer(group))

    def __call__(self, x: mx.array) -> mx.array:
        squares = self.tp_reduce(mx.sum(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True))
        scale = mx.rsqrt(squares / self.width + self.eps)
        return (x.astype(mx.float32) * scale).astype(x.dtype) * self.weight


def split_norm(module: nn.Module, name: str, width: int, group: SliceGroup) -> bool:
    """Replace ``module[name]``, an ``nn.RMSNorm`` over ``width`` (all heads), by its group slice; False when it
    is not one (another norm class, or another width)."""
    norm = module.get(name)
    if type(norm) is not nn.RMSNorm or norm.weight.shape[-1] != width or width % group.size():
        return False
    module[name] = GroupRMSNorm(norm, group)
    return True
