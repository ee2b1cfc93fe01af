"""MoE blocks sliced across a tensor group: every expert split like a dense MLP, one all-reduce per block.

As mlx-lm's own ``shard()`` of qwen3_moe / deepseek_v3 / gpt_oss does it: each
routed expert of a ``SwitchGLU`` (``SwitchMLP``), whose ``SwitchLinear``
weights are shaped (experts, out, in), is split over its intermediate width
(gate and up column-parallel, down row-parallel, ``shard_inplace``), and so is
every dense shared expert beside it. The router and any gate on the shared
expert stay whole on every member, so every member routes alike. The experts'
outputs are then partial sums that the block only weights and adds (linear), so
the block's output is summed across the group once (not once per expert
layer): by the group's own ``TensorGroup.all_sum`` (neighbour exchanges) in a
pipeline of several stages (MLX's ring cannot split a group, ``reduce``) and
in any group of 2; by MLX's ``all_sum`` over the world with pure tensor
parallelism over more hosts.

A row-parallel layer's bias would be added by every member before the sum:
only member 0 keeps it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import SliceGroup
from mlxpipe.worker.tensor.reduce import reducer

# Routed experts: (column-parallel projections, the row-parallel output).
_EXPERTS: dict[type, tuple[tuple[str, ...], str]] = {
    SwitchGLU: (("gate_proj", "up_proj"), "down_proj"), SwitchMLP: (("fc1",), "fc2"),
}


def _experts() -> dict[type, tuple[tuple[str, ...], str]]:
    """``_EXPERTS``, and mlx-vlm's copies of the same classes where a vision-language model loaded them (Kimi-VL's
    language model); looked up, not imported, so that a text model's rank never imports mlx-vlm."""
    vlm = sys.modules.get("mlx_vlm.models.switch_layers")
    if vlm is None:
        return _EXPERTS
    return {**_EXPERTS, vlm.SwitchGLU: _EXPERTS[SwitchGLU], vlm.SwitchMLP: _EXPERTS[SwitchMLP]}


class ReducedMoE:
    """Marks an MoE block whose output this module sums across the tensor group (``tp_reduce``)."""

    tp_reduce: Callable[[mx.array], mx.array]


_REDUCING: dict[type, type] = {}


def moe_blocks(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``block`` that hold routed experts as a child: a ``SwitchGLU`` or ``SwitchMLP``, or a list
    ``experts`` of dense MLPs (DBRX)."""
    found, experts = [], tuple(_experts())
    for name, module in block.named_modules():
        children = module.children()
        listed = children.get("experts")
        if any(isinstance(child, experts) for child in children.values()) or (
            isinstance(listed, list) and len(listed) > 1 and all(isinstance(e, nn.Module) for e in listed)
        ):
            found.append((name, module))
    return found


def shard_moe(module: nn.Module, group: SliceGroup, dense_layouts: list[tuple[tuple[str, ...], str]], where: str,
              hint: str) -> None:
    """Split ``module``'s routed and shared experts in place for ``group``; sum its output across it once.

    ``dense_layouts`` are the dense MLP shapes a shared (or listed) expert may have (``blocks``' own). What
    is left whole must be a router: a weight as wide as the block's output there would be added by every
    member (ModelError naming ``where``).
    """
    split: list[tuple[str, nn.Module, tuple[tuple[str, ...], str]]] = []
    experts = _experts()
    for name, sub in module.named_modules():
        layout = experts.get(type(sub)) or next(
            (lay for lay in dense_layouts if _has_dense(sub, (*lay[0], lay[1]))), None
        )
        if sub is not module and layout is not None:
            split.append((name, sub, layout))
    if not split:
        raise ModelError(f"{where}: its MoE block holds no experts the tensor-parallel sharder knows", hint=hint)
    hidden = split[0][1][split[0][2][1]].weight.shape[-2]  # the down projection's output width
    done = {id(m) for _, sub, _ in split for _, m in sub.named_modules()}
    for name, sub in module.named_modules():
        for key, value in sub.items() if id(sub) not in done else ():
            if isinstance(value, mx.array) and value.ndim > 1 and value.shape[-2] == hidden:
                what = ".".join(p for p in (name, key) if p)
                raise ModelError(f"{where}: {what} {tuple(value.shape)} in its MoE block is neither an expert the "
                                 "tensor-parallel sharder knows nor a router", hint=hint)
    for _, sub, layout in split:
        for name in layout[0]:
            shard_inplace(sub[name], "all-to-sharded", group=group)
        down = sub[layout[1]]
        shard_inplace(down, "sharded-to-all", group=group)
        if "bias" in down and group.rank() != 0:
            down["bias"] = mx.zeros_like(down["bias"])
    cls = type(module)
    if cls not in _REDUCING:
        _REDUCING[cls] = type(cls.__name__, (cls, ReducedMoE), {"__call__": _reduced_call(cls)})
    module.__class__ = _REDUCING[cls]
    # Not a module attribute mlx would treat as a parameter: a plain attribute on the instance.
    object.__setattr__(module, "tp_reduce", reducer(group))


def _reduced_call(cls: type) -> Callable[..., mx.array]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> mx.array:
        reduced: mx.array = self.tp_reduce(cls.__call__(self, *args, **kwargs))
        return reduced

    return __call__


def _has_dense(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(type(module.get(name)) in (nn.Linear, nn.QuantizedLinear) for name in names)
