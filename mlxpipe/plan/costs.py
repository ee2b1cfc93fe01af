"""What each layer of a model costs: bytes held, files, KV cache, work per token; a host's budget.

Pure: from the model's metadata and the hostfile alone. A layer's work per token is
the bytes it reads (routed experts counted by the share a token uses); rank 0 also
reads the vocabulary head.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxpipe.host import GB, Host
from mlxpipe.model.metadata import ModelMetadata, kv_bytes_per_token

# Activations, the runtime and the tokenizer: held back from every host's budget.
RUNTIME_OVERHEAD = GB // 2
# What macOS lets the GPU wire by default (iogpu.wired_limit_mb = 0): about
# two thirds of RAM up to 36 GB, three quarters above.
SMALL_MAC_GB = 36

@dataclass(frozen=True)
class Costs:
    """A model's costs per layer, and what every rank holds besides its layers."""

    layer_bytes: list[int]
    shared_bytes: int
    layer_files: list[set[str]]
    shared_files: set[str]
    kv: list[tuple[int, int | None]]
    layer_work: list[int]  # bytes each layer reads per generated token
    head_work: int  # bytes the vocabulary head reads per token (rank 0's extra)
    # Tensor parallelism (plan/tensor.py): each layer's bytes a group splits, and those every member keeps
    # whole (the two add up to layer_bytes); of shared_bytes, the vocabulary head's and embedding's.
    sharded_bytes: list[int] = field(default_factory=list)
    replicated_bytes: list[int] = field(default_factory=list)
    vocab_bytes: int = 0
    members: int = 1  # these are the costs of one member of a tensor-parallel group of this many
    # A vision-language model's vision tower and projector: only the first stage (layer 0's) holds them.
    vision_bytes: int = 0
    vision_files: set[str] = field(default_factory=set)


# The routed experts' weights (mlx-lm's stacked ``switch_mlp``, or per-expert tensors).
_EXPERT_RE = re.compile(r"\.(switch_mlp|experts)\.")
_HEAD_RE = re.compile(r"(^|\.)lm_head\.")
_EMBED_RE = re.compile(r"(^|\.)embed_tokens\.")
# A vision-language model's towers and projectors, as mlx-vlm's checkpoints name them.
_VISION_RE = re.compile(r"^(vision_tower|vision_model|visual|multi_modal_projector|mm_projector|embed_vision)\.")
# A layer's tensors that every member of a tensor-parallel group keeps whole: norms, MoE routers
# (``mlp.gate.weight``, ``router``; never ``gate_proj``), and every 1-D tensor (biases, norm
# scales: small, and a row-parallel layer's bias is added after the sum).
_REPLICATED_RE = re.compile(r"norm|(^|\.)(gate|router|shared_expert_gate)\.")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")
_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def model_costs(meta: ModelMetadata) -> Costs:
    n = meta.num_layers
    layer_bytes, layer_work, replicated = [0] * n, [0] * n, [0] * n
    layer_files: list[set[str]] = [set() for _ in range(n)]
    shared_bytes, shared_files = 0, set()
    head_bytes = embed_bytes = vision_bytes = 0
    vision_files: set[str] = set()
    active, experts = active_experts(meta.text_config)
    for t in meta.tensors:
        layer = meta.layer_of(t)
        if layer is None and _VISION_RE.search(t.name):
            vision_bytes += t.nbytes
            vision_files.add(t.file)
        elif layer is None:
            shared_bytes += t.nbytes
            shared_files.add(t.file)
            if _HEAD_RE.search(t.name):
                head_bytes += t.nbytes
            elif _EMBED_RE.search(t.name):
                embed_bytes += t.nbytes
        elif layer < n:  # layers past num_hidden_layers (MTP) are dropped by sanitize
            layer_bytes[layer] += t.nbytes
            if is_replicated(t.name, t.shape):
                replicated[layer] += t.nbytes
            layer_files[layer].add(t.file)
            routed = experts and _EXPERT_RE.search(t.name)
            layer_work[layer] += t.nbytes * active // experts if routed else t.nbytes
    # Tied embeddings: the head is the embedding matrix itself.
    head_work = head_bytes or embed_bytes
    sharded = [total - kept for total, kept in zip(layer_bytes, replicated, strict=True)]
    return Costs(layer_bytes, shared_bytes, layer_files, shared_files, kv_bytes_per_token(meta),
                 layer_work, head_work, sharded, replicated, head_bytes + embed_bytes,
                 vision_bytes=vision_bytes, vision_files=vision_files)


def is_replicated(name: str, shape: Sequence[int]) -> bool:
    """A layer tensor every member of a tensor-parallel group keeps whole (see ``_REPLICATED_RE``)."""
    return len(shape) < 2 or bool(_REPLICATED_RE.search(name))


def active_experts(config: dict[str, Any]) -> tuple[int, int]:
    """(experts each token uses, routed experts per layer); (0, 0) for a dense model."""
    active = next((config[k] for k in _EXPERTS_PER_TOKEN_KEYS if isinstance(config.get(k), int)), 0)
    experts = next((config[k] for k in _EXPERTS_KEYS if isinstance(config.get(k), int)), 0)
    return (active, experts) if 0 < active <= experts else (0, 0)


def kv_bytes(kv: Sequence[tuple[int, int | None]], tokens: int) -> int:
    """KV-cache bytes for ``tokens`` of context over the given layers."""
    return sum(per * (min(tokens, w) if w else tokens) for per, w in kv)


def budget_bytes(host: Host) -> int | None:
    """What the GPU may use on ``host``: the wired limit, else macOS's default share."""
    if host.wired_limit_gb:
        return int(host.wired_limit_gb * GB)
    if not host.memory_gb:
        return None
    share = 0.67 if host.memory_gb <= SMALL_MAC_GB else 0.75
    return int(host.memory_gb * share * GB)


def max_context(kv: Sequence[tuple[int, int | None]], free: int, limit: int) -> int:
    """The longest context whose KV cache fits in ``free`` bytes (binary search)."""
    if free < 0:
        return 0
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_bytes(kv, mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def rank_weight_bytes(costs: Costs, start: int, end: int) -> int:
    """What a rank of layers ``start`` .. ``end`` holds: the first stage adds the vision tower and projector."""
    vision = costs.vision_bytes if start == 0 else 0
    return costs.shared_bytes + vision + sum(costs.layer_bytes[start:end])
