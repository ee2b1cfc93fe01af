"""What one token costs each layer of a model, and what crosses a link: the cost model's view of the model, from
its metadata alone (``ModelWork``).

Bytes come from ``plan/costs.py`` (routed experts at the share a token uses); FLOPs from each weight's
element count (2 per weight a token uses, packed quantized weights unpacked), plus attention over the
context. Pure: no MLX, no network. ``plan/estimate.py`` turns these into seconds on a cluster's hosts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxpipe.model.facts import CONFIG_DTYPE_BYTES, DTYPE_BYTES, layer_windows
from mlxpipe.model.metadata import ModelMetadata, kv_bytes_per_token
from mlxpipe.plan.costs import _EXPERT_RE, active_experts, model_costs
from mlxpipe.plan.tensor import HEAD_KEYS, kv_splits

_SCALES_RE = re.compile(r"\.(scales|biases)$")


@dataclass(frozen=True)
class ModelWork:
    """What one token costs each layer of a model, and what crosses a link: from its metadata alone."""

    layer_bytes: tuple[int, ...]  # weight bytes a decode step reads (routed experts: the share a token uses)
    layer_flops: tuple[int, ...]  # FLOPs per token of the layer's matrix products (2 per weight a token uses)
    attention_flops: tuple[int, ...]  # FLOPs per token per token of context it attends to
    kv: tuple[tuple[int, int | None], ...]  # KV-cache bytes per token of context, and the window (None: all)
    head_bytes: int
    head_flops: int  # per token
    hidden: int  # the hidden state's width
    activation_bytes: int  # bytes per element of the hidden state
    vocab: int
    kv_splits: bool = True  # a tensor-parallel member holds 1/T of the KV cache (not with MLA)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    def hidden_bytes(self, tokens: int) -> int:
        """Bytes of the hidden state of ``tokens`` tokens (what a hop or an all-reduce carries)."""
        return tokens * self.hidden * self.activation_bytes


def model_work(meta: ModelMetadata) -> ModelWork:
    """``meta``'s ``ModelWork``: bytes from ``plan/costs.py``, FLOPs from each weight's element count."""
    costs = model_costs(meta)
    c = meta.text_config
    n = meta.num_layers
    active, experts = active_experts(c)
    quant = meta.config.get("quantization") or meta.config.get("quantization_config") or {}
    flops = [0] * n
    head_params = embed_params = 0
    for t in meta.tensors:
        if len(t.shape) < 2 or _SCALES_RE.search(t.name):
            continue
        params = _params(t.name, t.dtype, t.shape, quant)
        layer = meta.layer_of(t)
        if layer is None:
            if "lm_head" in t.name:
                head_params += params
            elif "embed_tokens" in t.name or "wte" in t.name:
                embed_params += params
            continue
        if layer < n:
            routed = experts and _EXPERT_RE.search(t.name)
            flops[layer] += 2 * (params * active // experts if routed else params)
    heads = next((c[k] for k in HEAD_KEYS if isinstance(c.get(k), int)), 1) or 1
    hidden = int(c.get("hidden_size") or c.get("d_model") or c.get("n_embd") or 0)
    head_dim = int(c.get("head_dim") or (hidden // heads if heads else 0))
    windows = layer_windows(c, n)
    kv = kv_bytes_per_token(meta)
    activation = _activation_bytes(meta)
    return ModelWork(
        layer_bytes=tuple(costs.layer_work),
        layer_flops=tuple(flops),
        # QK^T and AV: 2 FLOPs per multiply-add, each over heads x head_dim per context token.
        attention_flops=tuple(4 * heads * head_dim for _ in range(n)),
        kv=tuple((per, w if w else None) for (per, _), w in zip(kv, windows, strict=True)),
        head_bytes=costs.head_work,
        head_flops=2 * (head_params or embed_params),
        hidden=hidden,
        activation_bytes=activation,
        vocab=int(c.get("vocab_size") or 0),
        kv_splits=kv_splits(c),
    )


def _params(name: str, dtype: str, shape: Sequence[int], quant: dict[str, Any]) -> int:
    """The weights a tensor holds: packed quantized ones (uint32) hold 32 / bits each."""
    count = math.prod(shape)
    if dtype.upper() not in ("U32", "I32") or not quant:
        return count
    module = name.rsplit(".", 1)[0]
    bits = quant.get(module, {}).get("bits") if isinstance(quant.get(module), dict) else None
    return count * 32 // int(bits or quant.get("bits") or 4)


def _activation_bytes(meta: ModelMetadata) -> int:
    c = meta.text_config
    dtype = c.get("torch_dtype") or c.get("dtype") or meta.config.get("torch_dtype")
    if dtype in CONFIG_DTYPE_BYTES:
        return CONFIG_DTYPE_BYTES[dtype]
    norms = [t for t in meta.tensors if t.name.endswith("norm.weight")]
    return DTYPE_BYTES.get(norms[0].dtype, 2) if norms else 2
