"""Tiny collectives by which the ranks agree before they act alike: a minimum, a flag, a seed."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx


def agreed_min(group: Any, value: int) -> int:
    """The smallest of the ranks' ``value`` (a tiny collective on the CPU)."""
    if group.size() == 1:
        return value
    values = mx.distributed.all_gather(mx.array([value]), group=group, stream=mx.cpu)
    return int(values.min().item())


def all_agree(group: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a tiny collective on the CPU)."""
    return agreed_min(group, int(flag)) == 1


def seed_sampling(group: Any, seed: int | None, temp: float) -> None:
    """Seed sampling identically on every rank, so every rank picks the same token."""
    if seed is None:
        if temp == 0:
            return  # greedy: no randomness to share
        seed = shared_seed(group)
    mx.random.seed(int(seed))


def shared_seed(group: Any) -> int:
    """A random seed drawn by rank 0 and known to every rank."""
    mine = random.getrandbits(31) if group.rank() == 0 else 0
    if group.size() == 1:
        return mine
    shared = mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu)
    return int(shared.item())
