"""worker/groups.py without ranks: where each rank stands, and what a group of one does.

The exchanges between ranks run in ``e2e/test_tensor_parallel.py``; here the
arithmetic of stages and members is checked for every rank of a job, with an
object that answers ``rank()`` and ``size()`` as an MLX group does (the ranks'
placement is all these parts read of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import pytest

from mlxpipe.errors import UsageError
from mlxpipe.worker.groups import TensorGroup, Topology, single_topology


@dataclass(frozen=True)
class World:
    """Rank ``r`` of a job of ``n`` ranks, as MLX's group reports it."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize(("size", "tp", "stages"), [(1, 1, 1), (4, 1, 4), (4, 2, 2), (6, 3, 2), (4, 4, 1), (8, 2, 4)])
def test_groups_are_consecutive_ranks_and_group_g_is_stage_g(size: int, tp: int, stages: int) -> None:
    places = [Topology(World(r, size), tp) for r in range(size)]
    assert [(t.stage, t.tp_index) for t in places] == [(r // tp, r % tp) for r in range(size)]
    assert {t.stages for t in places} == {stages}
    assert [t.tensor.first for t in places] == [(r // tp) * tp for r in range(size)]
    assert [t.tensor.rank() for t in places] == [r % tp for r in range(size)]
    assert {t.tensor.size() for t in places} == {tp}
    assert [t.samples for t in places] == [r == 0 for r in range(size)]  # world rank 0 alone samples
    assert {t.sharded for t in places} == {tp > 1}


@pytest.mark.parametrize(("size", "tp"), [(4, 3), (3, 2), (2, 0), (2, -1), (1, 2)])
def test_a_group_size_that_does_not_divide_the_ranks_is_refused(size: int, tp: int) -> None:
    with pytest.raises(UsageError, match=rf"^--tp {tp} does not divide the job's {size} ranks into groups$"):
        Topology(World(0, size), tp)


@pytest.mark.parametrize(("size", "tp", "whole_world", "exchanges"), [
    (2, 2, True, True),  # two members: one message each way beats MLX's two-round ring all_sum
    (4, 4, True, False),  # pure tensor parallelism of more than 2: MLX's own collectives
    (4, 2, False, True),  # inside a pipeline: the ring cannot split the world, so neighbour exchanges
    (6, 3, False, True),
])
def test_who_sums_by_its_own_exchanges(size: int, tp: int, whole_world: bool, exchanges: bool) -> None:
    group = TensorGroup(World(size - 1, size), tp)
    assert (group.whole_world, group.exchanges) == (whole_world, exchanges)


def test_a_group_of_one_returns_what_it_is_given() -> None:
    topology = single_topology()
    assert (topology.rank, topology.size, topology.stages, topology.tp, topology.sharded) == (0, 1, 1, 1, False)
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    assert topology.tensor.all_sum(x) is x
    assert topology.tensor.all_gather(x, axis=0) is x


def test_only_member_0_of_a_stage_sends_on_to_the_next_stage() -> None:
    x = mx.ones((2,))
    # Members other than 0 hand the hidden state down their own chain (recv_up): send_down gives x back.
    assert Topology(World(3, 4), 2).send_down(x) is x
