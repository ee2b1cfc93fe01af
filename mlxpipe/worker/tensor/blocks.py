"""The generic sharder: one block's attention and MLP sliced across a tensor group, for models
without their own ``shard()``.

Attention is split by heads: the query, key and value projections column-parallel
(each member computes its heads; a fused ``qkv_proj`` is split part by part,
``[Q | K | V]``), the output projection row-parallel (partial sums, added across
the group), and the head counts the attention code reads divided by the group's
size. MLPs: gate and up (or ``fc1``) column-parallel, a fused ``gate_up_proj``
half by half, down (or ``fc2``) row-parallel. What is left whole must be a norm
or a bias (one vector per layer); any other weight is a shape this sharder does
not know, refused in one line rather than computed wrong.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from mlxpipe.errors import ModelError

# Attention layouts: (column-parallel projections, the row-parallel output).
_ATTENTION = [
    (("q_proj", "k_proj", "v_proj"), "o_proj"),
    (("q_proj", "k_proj", "v_proj"), "out_proj"),
    (("q_proj", "k_proj", "v_proj"), "dense"),
    (("wq", "wk", "wv"), "wo"),
]
_FUSED_QKV = ("qkv_proj", "o_proj")
# MLP layouts: (column-parallel projections, the row-parallel output).
_MLP = [
    (("gate_proj", "up_proj"), "down_proj"),
    (("w1", "w3"), "w2"),
    (("fc1",), "fc2"),
    (("c_fc",), "c_proj"),
    (("up_proj",), "down_proj"),
]
_FUSED_GATE_UP = ("gate_up_proj", "down_proj")
# The attributes attention code reads its head counts from.
_HEAD_COUNTS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEAD_COUNTS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
_REFUSED_FUSED = {"wqkv": "InternLM2's grouped wqkv", "query_key_value": "a per-head interleaved query_key_value",
                  "c_attn": "a fused c_attn", "Wqkv": "a fused Wqkv"}


def shard_block(block: nn.Module, group: Any, where: str) -> None:
    """Slice ``block``'s attention and MLP in place for ``group``; ModelError naming ``where`` otherwise."""
    n = group.size()
    attention = mlp = None
    for _, module in block.named_modules():
        if attention is None and _shard_attention(module, group, n, where):
            attention = module
        elif mlp is None and module is not attention and _shard_mlp(module, group):
            mlp = module
    if attention is None:
        raise ModelError(f"{where}: no attention projections the tensor-parallel sharder knows"
                         + _fused_note(block), hint="run it without --tp (a pipeline)")
    _check_rest(block, where)


def _has(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(module.get(name), (nn.Linear, nn.QuantizedLinear)) for name in names)


def _shard_attention(module: nn.Module, group: Any, n: int, where: str) -> bool:
    fused = _has(module, _FUSED_QKV)
    layout = next((lay for lay in _ATTENTION if _has(module, (*lay[0], lay[1]))), None)
    if not fused and layout is None:
        return False
    heads = _count(module, _HEAD_COUNTS)
    kv_heads = _count(module, _KV_HEAD_COUNTS) or heads
    if heads is None:
        raise ModelError(f"{where}: its attention keeps no head count the sharder can update")
    if heads % n or kv_heads % n:
        raise ModelError(f"{where}: {heads} attention heads and {kv_heads} KV heads do not divide by --tp {n}",
                         hint=f"use a --tp that divides {kv_heads}")
    q_width = (module["qkv_proj"].weight.shape[0] * heads // (heads + 2 * kv_heads) if fused
               else module[layout[0][0]].weight.shape[0])
    _check_head_norms(module, q_width // heads, where)
    if fused:
        kv_width = q_width * kv_heads // heads
        module["qkv_proj"] = shard_linear(module["qkv_proj"], "all-to-sharded",
                                          segments=[q_width, q_width + kv_width], group=group)
        module["o_proj"] = shard_linear(module["o_proj"], "sharded-to-all", group=group)
    else:
        for name in layout[0]:
            module[name] = shard_linear(module[name], "all-to-sharded", group=group)
        module[layout[1]] = shard_linear(module[layout[1]], "sharded-to-all", group=group)
    for names, total in ((_HEAD_COUNTS, heads), (_KV_HEAD_COUNTS, kv_heads)):
        for name in names:
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, total // n)
    return True


def _shard_mlp(module: nn.Module, group: Any) -> bool:
    if _has(module, _FUSED_GATE_UP):
        module["gate_up_proj"] = shard_linear(module["gate_up_proj"], "all-to-sharded", segments=2, group=group)
        module["down_proj"] = shard_linear(module["down_proj"], "sharded-to-all", group=group)
        return True
    layout = next((lay for lay in _MLP if _has(module, (*lay[0], lay[1]))), None)
    if layout is None:
        return False
    for name in layout[0]:
        module[name] = shard_linear(module[name], "all-to-sharded", group=group)
    module[layout[1]] = shard_linear(module[layout[1]], "sharded-to-all", group=group)
    return True


def _count(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_head_norms(module: nn.Module, head_dim: int, where: str) -> None:
    """Per-head query/key norms split with the heads; one norm over all heads' widths at once cannot."""
    for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
        norm = module.get(name)
        weight = norm.get("weight") if isinstance(norm, nn.Module) else None
        if weight is not None and weight.shape[-1] != head_dim:
            raise ModelError(f"{where}: its {name} normalizes across all heads at once, "
                             "which a split by heads would change", hint="run it without --tp (a pipeline)")


def _check_rest(block: nn.Module, where: str) -> None:
    """Every weight left whole in ``block`` must be a vector (a norm, a row-parallel layer's bias)."""
    for name, module in block.named_modules():
        if type(module).__module__ == "mlx.nn.layers.distributed":
            continue
        for key, value in module.items():
            if isinstance(value, mx.array) and value.ndim > 1:
                what = f"{name}.{key}" if name else key
                raise ModelError(f"{where}: {what} {tuple(value.shape)} is not a shape the tensor-parallel "
                                 "sharder knows (an MoE block's experts, a fused projection...)"
                                 + _fused_note(block), hint="run it without --tp (a pipeline)")


def _fused_note(block: nn.Module) -> str:
    for _, module in block.named_modules():
        for key, what in _REFUSED_FUSED.items():
            if key in module:
                return f" ({what} is not split yet)"
    return ""
