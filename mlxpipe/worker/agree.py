"""Tiny collectives by which the ranks agree before they act alike: a minimum, a flag, a seed, a tick's tokens."""

from __future__ import annotations

import random
from typing import cast

import mlx.core as mx


def agreed_min(group: mx.distributed.Group, value: int) -> int:
    """The smallest of the ranks' ``value`` (a tiny collective on the CPU)."""
    if group.size() == 1:
        return value
    values = mx.distributed.all_gather(mx.array([value]), group=group, stream=mx.cpu)
    return int(cast(int, values.min().item()))  # mlx types item() as any scalar


def all_agree(group: mx.distributed.Group, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a tiny collective on the CPU)."""
    return agreed_min(group, int(flag)) == 1


def seed_sampling(group: mx.distributed.Group, seed: int | None, temp: float) -> None:
    """Seed sampling identically on every rank, so every rank picks the same token."""
    if seed is None:
        if temp == 0:
            return  # greedy: no randomness to share
        seed = shared_seed(group)
    mx.random.seed(int(seed))


def shared_seed(group: mx.distributed.Group) -> int:
    """A random seed drawn by rank 0 and known to every rank."""
    mine = random.getrandbits(31) if group.rank() == 0 else 0
    if group.size() == 1:
        return mine
    shared = mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu)
    return int(cast(int, shared.item()))


def tick_collective(group: mx.distributed.Group, sampled: mx.array | None, rows: int, received: int | None) -> mx.array:
    """The engine's per-tick collective, lazy: rank 0's ``sampled`` tokens (``rows`` of them; None on the
    other ranks) on every rank and, with ``received`` (the messages this rank's inbox holds), every rank's
    count, one row per rank (see ``read_tick``)."""
    if group.size() == 1:
        assert sampled is not None
        mine = sampled.astype(mx.int32)
        return mine if received is None else mx.concatenate([mine, mx.array([received], mx.int32)])
    if received is None:
        mine = sampled.astype(mx.int32) if sampled is not None else mx.zeros((rows,), mx.int32)
        return mx.distributed.all_sum(mine, group=group, stream=mx.cpu)
    tokens = sampled.astype(mx.int32) if sampled is not None else mx.full((rows,), -1, mx.int32)
    mine = mx.concatenate([tokens, mx.array([received], mx.int32)])
    return mx.distributed.all_gather(mine, group=group, stream=mx.cpu).reshape(-1, rows + 1)


def tick_tokens(shared: mx.array, rows: int, counted: bool) -> mx.array:
    """Rank 0's tokens in ``tick_collective``'s result (``counted``: made with message counts), still lazy."""
    return shared.reshape(-1, rows + 1)[0, :rows] if counted else shared


def read_tick(shared: mx.array, rows: int, counted: bool) -> tuple[list[int], int]:
    """``tick_collective``'s result read: rank 0's tokens, and the message count every rank has (0 without)."""
    if not counted:
        return cast(list[int], shared.tolist()), 0
    values = cast(list[list[int]], shared.reshape(-1, rows + 1).tolist())
    return values[0][:rows], min(int(v[rows]) for v in values)
