"""Multi-head latent attention (DeepSeek's MLA) split by heads, for models without their own ``shard()``.

As mlx-lm's ``shard()`` of deepseek_v3 does it: the query's last projection
(``q_b_proj``, or ``q_proj`` without a query latent) and the latent's
up-projection to every head's key and value (``kv_b_proj``, laid out head by
head; or deepseek_v3's per-head ``embed_q`` / ``unembed_out``) are split by
heads, the output projection row-parallel. The down-projections to the latents
(``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms read the whole hidden
state and feed every head: they stay whole on every member, and so does the KV
cache (one latent all heads read).
"""

from __future__ import annotations

import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import SliceGroup

_LATENTS = ("q_a_proj", "kv_a_proj_with_mqa")  # kept whole: every head reads them
_QUERY = ("q_b_proj", "q_proj")
_HEADS = "num_heads"


def _linear(module: nn.Module, name: str) -> bool:
    return type(module.get(name)) in (nn.Linear, nn.QuantizedLinear)


def shard_mla(module: nn.Module, group: SliceGroup, where: str, hint: str) -> list[nn.Module] | None:
    """Split ``module`` in place if it is an MLA attention; the modules not to check further (the latents'
    projections, whole, and the per-head tables, split here); None: not MLA."""
    if not (_linear(module, "kv_a_proj_with_mqa") and _linear(module, "o_proj")):
        return None
    n, rank = group.size(), group.rank()
    heads = getattr(module, _HEADS, None)
    query = next((name for name in _QUERY if _linear(module, name)), None)
    per_head = isinstance(module.get("embed_q"), nn.Module) and isinstance(module.get("unembed_out"), nn.Module)
    if not isinstance(heads, int) or query is None or not (_linear(module, "kv_b_proj") or per_head):
        raise ModelError(f"{where}: its latent attention has no query, key/value up-projection or head count the "
                         "tensor-parallel sharder knows", hint=hint)
    if heads % n:
        raise ModelError(f"{where}: {heads} attention heads do not divide by --tp {n}", hint=hint)
    module[query] = shard_linear(module[query], "all-to-sharded", group=group)
    if per_head:
        part = heads // n
        for name in ("embed_q", "unembed_out"):
            module[name].apply(lambda w: w[rank * part : (rank + 1) * part])
    else:
        module["kv_b_proj"] = shard_linear(module["kv_b_proj"], "all-to-sharded", group=group)
    module["o_proj"] = shard_linear(module["o_proj"], "sharded-to-all", group=group)
    setattr(module, _HEADS, heads // n)
    # What the block's final check must not refuse: the latents (whole), the per-head tables (split here).
    return [module[name] for name in (*_LATENTS, "embed_q", "unembed_out") if name in module]
