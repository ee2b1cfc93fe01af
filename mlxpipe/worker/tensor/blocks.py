"""The generic sharder: one block's attention and MLP sliced across a tensor group, for models
without their own ``shard()``.

Attention is split by heads: the query, key and value projections column-parallel
(each member computes its heads; a fused projection by its real layout:
``[Q | K | V]`` part by part, InternLM2's grouped ``wqkv`` by whole KV groups),
the output projection row-parallel (partial sums, added across the group), and
the head counts and widths the attention code reads divided by the group's size;
a gate on the attention's output and per-head gains go with the heads. MLPs: gate
and up (or ``fc1``...) column-parallel, a fused ``gate_up_proj`` half by half,
down (or ``fc2``...) row-parallel. MoE blocks (``experts``), latent attention
(``mla``) and norms over all heads (``norms``) have their own modules. What is
left whole must be a norm or a bias (one vector per layer); any other weight is
a shape this sharder does not know, refused in one line rather than computed
wrong.
"""

from __future__ import annotations

from typing import TypeGuard

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import SliceGroup
from mlxpipe.worker.tensor.experts import moe_blocks, shard_moe
from mlxpipe.worker.tensor.mla import shard_mla
from mlxpipe.worker.tensor.norms import GroupRMSNorm, split_norm

# Attention layouts: (column-parallel projections, the row-parallel output).
_ATTENTION = [
    (("q_proj", "k_proj", "v_proj"), "o_proj"),
    (("q_proj", "k_proj", "v_proj"), "out_proj"),
    (("q_proj", "k_proj", "v_proj"), "dense"),
    (("wq", "wk", "wv"), "wo"),
    (("c_q", "c_k", "c_v"), "c_proj"),
    (("attn_query", "attn_key", "attn_value"), "attn_resid"),
    # Cross-layer attention (Hunyuan's CLA): queries only, the keys and values of an earlier layer's cache,
    # which that layer's own split already sliced by KV heads.
    (("q_proj",), "o_proj"),
]
# Fused projections (fused, the row-parallel output) and how their rows are laid out:
# "parts" is [Q | K | V], split part by part; "grouped" is per KV head its query heads then
# its key and value heads (InternLM2's wqkv, phi3small) or per head [q k v] (GPT-NeoX), where a
# contiguous split gives each member whole groups. A name some models lay out differently is
# looked up by the model's module (query_key_value).
_FUSED_QKV = [("qkv_proj", "o_proj"), ("qkv_proj", "out_proj"), ("Wqkv", "out_proj"), ("c_attn", "c_proj"),
              ("wqkv", "wo"), ("query_key_value", "dense"), ("q_k_v_proj", "out_proj")]
_FUSED_LAYOUT: dict[str, str | dict[str, str]] = {
    "wqkv": "grouped",
    "query_key_value": {"gpt_neox": "grouped", "phi3small": "grouped", "bailing_moe": "parts",
                        "bailing_moe_linear": "parts", "bailing_hybrid": "parts"},
}
# MLP layouts: (column-parallel projections, the row-parallel output).
_MLP = [
    (("gate_proj", "up_proj"), "down_proj"),
    (("w1", "w3"), "w2"),
    (("w1", "v1"), "w2"),
    (("fc1",), "fc2"),
    (("c_fc",), "c_proj"),
    (("up_proj",), "down_proj"),
    (("c_fc_0", "c_fc_1"), "c_proj"),
    (("w1", "w2"), "c_proj"),
    (("fc_in",), "fc_out"),
    (("mlp_gate", "mlp_linear"), "mlp_resid"),
    (("dense_h_to_4h",), "dense_4h_to_h"),
]
# Fused [gate | up] projections, split half by half: (fused, the row-parallel output).
_FUSED_GATE_UP = [("gate_up_proj", "down_proj"), ("proj_1", "proj_2")]
# Projection widths some attention code splits its fused output by (PLaMo 3, Spark 2.5).
_WIDTHS = ("q_proj_dim", "k_proj_dim", "v_proj_dim", "q_size", "kv_size")
# Modules holding one parameter per query head (Talkie's head_gain).
_PER_HEAD = ("head_gain",)
# The model's width, read by some attention code as the width of all its heads together.
_MODEL_WIDTHS = ("d_model", "hidden_size")
# Gates on the attention's output (sigmoid(gate(x)) * attention before the output projection).
_OUTPUT_GATES = ("g_proj", "gate_proj")
_HINT = "run it without --tp (a pipeline)"
# A block's parts that read and write the residual stream only (whole on every member, each computes
# the same): Gemma 3n/4's per-layer inputs, Gemma 3n's AltUp and LAuReL.
_REPLICATED = ("per_layer_input_gate", "per_layer_projection", "altup", "laurel")
# The attributes attention code reads its head counts from.
_HEAD_COUNTS = ("n_heads", "num_heads", "num_attention_heads", "n_head", "q_num_heads")
_KV_HEAD_COUNTS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "k_num_heads", "v_num_heads")


def shard_block(block: nn.Module, group: SliceGroup, where: str) -> None:
    """Slice ``block``'s attention and MLP in place for ``group``; ModelError naming ``where`` otherwise."""
    n = group.size()
    # MoE blocks first: their shared experts are dense MLPs that must not reduce on their own.
    moe = moe_blocks(block)
    for _, module in moe:
        shard_moe(module, group, _MLP, where, _HINT)
    inside = {id(sub) for _, module in moe for _, sub in module.named_modules()}
    attention = mlp = None
    for _, module in block.named_modules():
        if id(module) in inside:
            continue
        kept = shard_mla(module, group, where, _HINT) if attention is None else None
        if kept is not None:
            attention = module
            inside |= {id(k) for k in kept}
        elif attention is None and _shard_attention(module, group, n, where):
            attention = module
        elif mlp is None and module is not attention and _shard_mlp(module, group):
            mlp = module
    if mlp is not None and getattr(mlp, "activation_sparsity", 0) > 0:
        raise ModelError(f"{where}: its MLP keeps only the activations above a cutoff taken over its whole hidden "
                         "width (activation sparsity), which a split of that width would change", hint=_HINT)
    if attention is None and mlp is None and not moe:
        parts = ", ".join(name for name, child in block.children().items() if isinstance(child, nn.Module))
        raise ModelError(f"{where}: no attention or MLP projections the tensor-parallel sharder knows "
                         f"(its parts: {parts})",
                         hint=_HINT)
    _check_rest(block, where, inside)


def _has(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(is_plain_linear(module.get(name)) for name in names)


def is_plain_linear(module: object) -> TypeGuard[nn.Linear | nn.QuantizedLinear]:
    """mlx's own ``Linear`` or ``QuantizedLinear``: a model's subclass may lay out or use its weight otherwise."""
    return type(module) in (nn.Linear, nn.QuantizedLinear)


def _fused_layout(module: nn.Module) -> tuple[tuple[str, str] | None, str]:
    """The fused q/k/v projection of ``module`` and its layout ("parts" or "grouped"); "unknown" when the
    name is laid out differently by different models and this one is not known."""
    fused = next((lay for lay in _FUSED_QKV if _has(module, lay)), None)
    if fused is None:
        return None, ""
    kind = _FUSED_LAYOUT.get(fused[0], "parts")
    if isinstance(kind, dict):
        return fused, kind.get(type(module).__module__.rsplit(".", 1)[-1], "unknown")
    return fused, kind


def _shard_attention(module: nn.Module, group: SliceGroup, n: int, where: str) -> bool:
    fused, kind = _fused_layout(module)
    layout = None if fused else next((lay for lay in _ATTENTION if _has(module, (*lay[0], lay[1]))), None)
    if fused is not None:
        first = fused[0]
    elif layout is not None:
        first = layout[0][0]
    else:
        return False
    if fused is not None and kind == "unknown":
        raise ModelError(f"{where}: its fused {fused[0]} has a row layout the tensor-parallel sharder does not "
                         "know", hint=_HINT)
    heads = _count(module, _HEAD_COUNTS)
    if heads is None:
        raise ModelError(f"{where}: its attention keeps no head count the sharder can update", hint=_HINT)
    kv_heads = _count(module, _KV_HEAD_COUNTS) or heads
    if heads % n or kv_heads % n:
        fits = [str(t) for t in range(2, kv_heads + 1) if heads % t == 0 and kv_heads % t == 0]
        raise ModelError(f"{where}: {heads} attention heads and {kv_heads} KV heads do not divide by --tp {n}",
                         hint=f"use --tp {' or '.join(fits)}" if fits else _HINT)
    width = module[first].weight.shape[0]
    q_width = width * heads // (heads + 2 * kv_heads) if fused else width
    kv_width = q_width * kv_heads // heads
    for name, width in (("q_norm", q_width), ("k_norm", kv_width)):
        split_norm(module, name, width, group)
    _check_head_norms(module, q_width // heads, where)
    if fused:
        segments = [q_width, q_width + kv_width] if kind == "parts" else 1
        module[fused[0]] = shard_linear(module[fused[0]], "all-to-sharded", segments=segments, group=group)
        module[fused[1]] = shard_linear(module[fused[1]], "sharded-to-all", group=group)
    elif layout is not None:
        for name in layout[0]:
            module[name] = shard_linear(module[name], "all-to-sharded", group=group)
        module[layout[1]] = shard_linear(module[layout[1]], "sharded-to-all", group=group)
    for name in _OUTPUT_GATES:
        # A gate on the attention's output, per head or per head and channel: split with the heads.
        gate = module.get(name)
        if is_plain_linear(gate) and gate.weight.shape[0] in (q_width, heads):
            module[name] = shard_linear(gate, "all-to-sharded", group=group)
    for names, total in ((_HEAD_COUNTS, heads), (_KV_HEAD_COUNTS, kv_heads)):
        for name in names:
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, total // n)
    start, part = group.rank() * (heads // n), heads // n
    for name in _PER_HEAD:
        # Per-head parameters (a gain per query head): each member keeps its heads' entries.
        if isinstance(module.get(name), nn.Module):
            module[name].apply(lambda w: w[start : start + part])
    for name in _WIDTHS:
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, getattr(module, name) // n)
    for name in _MODEL_WIDTHS:
        # The model's width where the attention code uses it as the queries' (DBRX's split, nanochat's reshape).
        if getattr(module, name, None) == q_width:
            setattr(module, name, q_width // n)
    return True


def _shard_mlp(module: nn.Module, group: SliceGroup) -> bool:
    fused = next((lay for lay in _FUSED_GATE_UP if _has(module, lay)), None)
    if fused is not None:
        module[fused[0]] = shard_linear(module[fused[0]], "all-to-sharded", segments=2, group=group)
        module[fused[1]] = shard_linear(module[fused[1]], "sharded-to-all", group=group)
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
    """Per-head query/key norms split with the heads; one norm over all heads' widths at once cannot, unless
    ``norms`` split it (an RMSNorm)."""
    for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
        norm = module.get(name)
        if isinstance(norm, GroupRMSNorm):
            continue
        weight = norm.get("weight") if isinstance(norm, nn.Module) else None
        if weight is not None and weight.shape[-1] != head_dim:
            raise ModelError(f"{where}: its {name} normalizes across all heads at once, "
                             "which a split by heads would change", hint=_HINT)


def _check_rest(block: nn.Module, where: str, moe: set[int]) -> None:
    """Every weight left whole in ``block`` must be a vector (a norm, a row-parallel layer's bias), or an
    MoE block's router (``moe``: the modules of its MoE blocks, replicated on purpose)."""
    for name, module in block.named_modules():
        if type(module).__module__ == "mlx.nn.layers.distributed" or id(module) in moe \
                or name.split(".")[0] in _REPLICATED:
            continue
        for key, value in module.items():
            if isinstance(value, mx.array) and value.ndim > 1:
                what = f"{name}.{key}" if name else key
                raise ModelError(f"{where}: {what} {tuple(value.shape)} is a weight the tensor-parallel "
                                 "sharder does not know how to split", hint=_HINT)
