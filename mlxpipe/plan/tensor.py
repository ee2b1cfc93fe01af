"""Tensor parallelism in the plan: groups of hosts, what a member holds, what refuses a group size.

``--tp T``: the hostfile's hosts, in order, form groups of T consecutive ranks; group g
(ranks ``g*T .. g*T+T-1``) is pipeline stage g, and stage 0 runs the LAST layers, as
rank 0 does without ``--tp``. Inside a group each member holds 1/T of the attention
and MLP weights (split by heads, and by the MLP's hidden width; an MoE block's routed
and shared experts each by their own hidden width), 1/T of the vocabulary
head and of the embedding (split by vocabulary), and 1/T of the KV cache (split by KV
heads); norms, the biases and routers of the layers whose output is summed are
replicated on every member.

Pure: from the model's config and tensor names alone (no MLX).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mlxpipe.errors import UsageError
from mlxpipe.host import Host
from mlxpipe.plan.costs import Costs, budget_bytes

# Head counts in mlx-lm's ModelArgs spellings (the first one a config has counts; a list
# gives one count per layer: OpenELM's num_query_heads / num_kv_heads).
HEAD_KEYS = ("num_attention_heads", "n_heads", "n_head", "num_heads", "num_query_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv", "multi_query_group_num")



def check_tp(tp: int, hosts: int, flag: str = "--tp") -> int:
    """``tp`` when it is a group size these hosts can form; else ``UsageError`` with what would work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UsageError(f"{flag} {tp!r}: a tensor-parallel group needs at least 1 host",
                         "use --tp 1 (pipeline only) or a divisor of the number of hosts")
    if hosts % tp:
        raise UsageError(
            f"{flag} {tp}: the hostfile's {hosts} hosts do not split into groups of {tp}",
            f"use --tp {_one_of(divisors(hosts))} with these hosts, or list a multiple of {tp} hosts",
        )
    return tp


def check_heads(config: dict[str, Any], tp: int, source: str) -> None:
    """Refuse a group size that does not divide the model's attention heads or KV heads."""
    if tp == 1:
        return
    for what, keys in (("attention heads", HEAD_KEYS), ("KV heads", KV_HEAD_KEYS)):
        key, counts = _head_counts(config, keys)
        bad = [c for c in counts if c % tp]
        if bad:
            fits = [t for t in divisors(bad[0]) if all(c % t == 0 for c in counts) and t > 1]
            hint = (f"use --tp {_one_of(fits)} (divisors of its {what})" if fits
                    else f"its {what} cannot be split: use --tp 1 (pipeline only)")
            raise UsageError(f"--tp {tp}: {source} has {bad[0]} {what} ({key}), not divisible by {tp}", hint)


def _head_counts(config: dict[str, Any], keys: Sequence[str]) -> tuple[str, list[int]]:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, [value]
        if isinstance(value, list) and value and all(isinstance(v, int) and v > 0 for v in value):
            return key, list(value)
    return "", []


def divisors(n: int) -> list[int]:
    """Every group size ``n`` splits into."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_of(values: Sequence[int]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def groups(size: int, tp: int) -> list[range]:
    """The ranks of each tensor-parallel group (stage order): ``[range(0, tp), range(tp, 2 * tp), ...]``."""
    return [range(g * tp, (g + 1) * tp) for g in range(size // tp)]


def stage_hosts(hosts: Sequence[Host], tp: int) -> list[Host]:
    """One host per stage, standing for its group: the member with the smallest budget
    (a member without ``memory_gb`` first, so that strategies needing it say so)."""
    groups = [hosts[g * tp:(g + 1) * tp] for g in range(len(hosts) // tp)]
    return [min(group, key=lambda h: (budget_bytes(h) is not None, budget_bytes(h) or 0)) for group in groups]


def kv_splits(config: dict[str, Any]) -> bool:
    """The KV cache splits by KV heads (not with MLA, whose one latent every head reads)."""
    return not config.get("kv_lora_rank")


def member_costs(costs: Costs, tp: int, config: dict[str, Any]) -> Costs:
    """What one member of a group of ``tp`` holds and reads, per layer (ceil: a part never rounds to 0)."""
    if tp == 1:
        return costs

    def part(n: int) -> int:
        return -(-n // tp)

    kv = costs.kv if not kv_splits(config) else [(part(per), w) for per, w in costs.kv]
    return replace(
        costs,
        layer_bytes=[r + part(s) for r, s in zip(costs.replicated_bytes, costs.sharded_bytes, strict=True)],
        shared_bytes=costs.shared_bytes - costs.vocab_bytes + part(costs.vocab_bytes),
        kv=kv,
        layer_work=[part(w) for w in costs.layer_work],
        head_work=part(costs.head_work),
        members=tp,
    )


def notes(tp: int, stages: int, config: dict[str, Any]) -> tuple[str, ...]:
    """What the plan assumed about a group, said once."""
    if tp == 1:
        return ()
    kv = "split by KV heads" if kv_splits(config) else "whole on every member (MLA: one latent all heads read)"
    layout = "one stage: pure tensor parallelism" if stages == 1 else f"{stages} pipeline stages"
    return (
        f"--tp {tp}: {layout}, each a group of {tp} consecutive hosts. Each member holds 1/{tp} of its stage's "
        f"attention and MLP weights (MoE experts included, each split by its hidden width) and of the vocabulary "
        f"head and embedding (split by vocabulary); norms and routers are replicated; the KV cache is {kv}. Every "
        f"member fetches its stage's whole files.",
    )
