"""worker/agree.py: the ranks' tiny collectives, on a group of one, and the reading of a gathered tick."""

from __future__ import annotations

import mlx.core as mx

from mlxpipe.worker.agree import (
    agreed_min,
    all_agree,
    read_tick,
    seed_sampling,
    shared_seed,
    tick_collective,
    tick_tokens,
)

ONE = mx.distributed.init()  # this process alone: a group of one


def test_a_group_of_one_agrees_with_itself() -> None:
    assert ONE.size() == 1
    assert agreed_min(ONE, 5) == 5
    assert all_agree(ONE, True) and not all_agree(ONE, False)
    assert 0 <= shared_seed(ONE) < 2**31


def test_a_seed_makes_every_rank_draw_alike_and_greedy_draws_nothing() -> None:
    seed_sampling(ONE, 7, temp=0.8)
    first = mx.random.uniform(shape=(3,))
    seed_sampling(ONE, 7, temp=0.8)
    assert mx.array_equal(first, mx.random.uniform(shape=(3,)))
    mx.random.seed(1)
    expected = mx.random.uniform(shape=(3,))
    mx.random.seed(1)
    seed_sampling(ONE, None, temp=0)  # greedy without a seed: the random state is left alone
    assert mx.array_equal(expected, mx.random.uniform(shape=(3,)))


def test_a_tick_of_one_rank_carries_its_tokens_and_its_message_count() -> None:
    sampled = mx.array([11, 12, 13])
    counted = tick_collective(ONE, sampled, rows=3, received=4)
    assert read_tick(counted, 3, counted=True) == ([11, 12, 13], 4)
    assert tick_tokens(counted, 3, counted=True).tolist() == [11, 12, 13]
    plain = tick_collective(ONE, sampled, rows=3, received=None)
    assert read_tick(plain, 3, counted=False) == ([11, 12, 13], 0)
    assert tick_tokens(plain, 3, counted=False).tolist() == [11, 12, 13]


def test_a_gathered_tick_gives_rank_0s_tokens_and_the_fewest_messages_any_rank_holds() -> None:
    # What all_gather returns on 3 ranks: one row per rank, its tokens (-1 but on rank 0) then its count.
    shared = mx.array([5, 6, 9, -1, -1, 8, -1, -1, 7], mx.int32)
    assert read_tick(shared, 2, counted=True) == ([5, 6], 7)  # only messages every rank holds are applied
    assert tick_tokens(shared, 2, counted=True).tolist() == [5, 6]
