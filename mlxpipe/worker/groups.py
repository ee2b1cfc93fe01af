"""Where a rank stands: its pipeline stage, its tensor-parallel group, and the exchanges between them.

With ``--tp T`` the job's ranks, in order, form groups of T consecutive ranks;
group g (ranks ``g*T .. g*T+T-1``) is pipeline stage g. As in mlx-lm, stage 0
runs the last layers and the vocabulary head, the highest stage the first
layers. T = 1 is the plain pipeline (a stage is one rank). Every rank, whatever its job
(serving, training, a links job), starts by joining the job's group (``init_group``).

MLX's ring backend has no ``Group.split`` and its ``send``/``recv`` only reach
the direct neighbours in the ring (r ± 1), so every exchange here is between
neighbours, in MLX's own ``send``/``recv`` (never a transport of ours):

* the pipeline hop from stage g+1 to stage g goes from rank ``(g+1)*T`` to its
  neighbour ``(g+1)*T - 1`` (the last member of stage g), and inside stage g
  the hidden state is passed on down the chain of members to member 0: every
  member of a stage receives from ``rank + 1``, members other than 0 forward
  to ``rank - 1``, and only member 0 sends on to the next stage;
* inside a group, ``TensorGroup.all_sum`` adds the members' partial sums. For
  T = 2 the two members swap their partials and each adds them (``a + b`` is
  bitwise ``b + a``), so both hold the same bits: one message each way, which
  beats MLX's ring ``all_sum`` (two rounds) even where the group is the world.
  For T > 2 the partial sum runs down the chain to member 0 and the total back
  up; with one stage of T > 2 the group is the world and MLX's own ``all_sum``
  does it.

On the ring, everything two neighbours exchange (these sends and receives,
the world's collectives) travels over the same sockets, in the order each
rank issues it, so every pair of neighbours must issue its operations in the
same order. A receive has no inputs in MLX's graph, so nothing in a lazy graph
orders it after a send of the same rank: MLX's evaluation may run it first,
and with the other member receiving too, both wait forever (it happened on a
batched decode tick of 2 stages x tp 2). So every exchange of a group is
scheduled (``mx.async_eval``) as it is built, its sends before its receives
where the member sends first, and its result too: the members run their
exchanges in program order, each one whole, whether or not the rest of the
graph is ever evaluated (a prefill chunk evaluates only the caches).

From MLX's sources: JACCL's mesh refuses ``Group.split`` too ("[jaccl] Group split
not supported") but reaches every peer; MPI splits (``MPI_Comm_split``). mlxpipe
uses the neighbour exchanges on every backend, since every backend has them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from mlxpipe.errors import LaunchError, UsageError

# What the tensor sharders slice for: an MLX group, or a TensorGroup standing in for one. mlx's shard_linear
# and mlx-lm's shard() read only its size() and rank(), but are annotated with MLX's Group alone: Any here.
SliceGroup = Any


class TensorGroup:
    """The members of one stage, as the sharded layers reduce and gather across them.

    It answers ``size()`` and ``rank()`` like an MLX group, so mlx-lm's
    ``shard()`` and mlx's ``shard_linear`` can slice weights for it.
    """

    def __init__(self, world: mx.distributed.Group, tp: int) -> None:
        self.world, self.tp = world, tp
        self.first = (world.rank() // tp) * tp  # the world rank of member 0
        self.index = world.rank() - self.first
        self.whole_world = tp == world.size()  # pure tensor parallelism
        # Whether the group sums and gathers by its own neighbour exchanges: inside a pipeline always (the
        # ring cannot split the world); with 2 members always too, being one message each way where MLX's
        # ring all_sum makes two rounds (a decode step's partial sum: 48 us against 136 us here).
        self.exchanges = tp == 2 or not self.whole_world

    def size(self) -> int:
        """The number of members."""
        return self.tp

    def rank(self) -> int:
        """This rank's index in the group."""
        return self.index

    def all_sum(self, x: mx.array) -> mx.array:
        """The sum of every member's ``x``, the same bits on every member."""
        if self.tp == 1:
            return x
        if not self.exchanges:
            return mx.distributed.all_sum(x, group=self.world)
        if self.tp == 2:
            return self._swap(x, lambda mine, other: mine + other)
        return self._chain_sum(x)

    def all_gather(self, x: mx.array, axis: int = -1) -> mx.array:
        """Every member's ``x`` joined along ``axis`` in member order."""
        if self.tp == 1:
            return x
        if self.tp == 2:
            first = self.index == 0
            return self._swap(x, lambda mine, other: mx.concatenate([mine, other] if first else [other, mine],
                                                                    axis=axis))
        if not self.exchanges:
            parts = mx.distributed.all_gather(mx.expand_dims(x, 0), group=self.world)
        else:
            parts = self._chain_gather(x)
        return mx.concatenate([parts[i] for i in range(self.tp)], axis=axis)

    # --- neighbour exchanges ---------------------------------------------------------

    def _send(self, x: mx.array, member: int) -> mx.array:
        return mx.distributed.send(x, self.first + member, group=self.world)

    def _recv(self, like: mx.array, member: int) -> mx.array:
        return mx.distributed.recv_like(like, self.first + member, group=self.world)

    @staticmethod
    def _issued(x: mx.array) -> mx.array:
        """``x`` scheduled now on the stream: after every exchange issued before it, before any issued after."""
        mx.async_eval(x)
        return x

    def _swap(self, x: mx.array, combine: Callable[[mx.array, mx.array], mx.array]) -> mx.array:
        """T = 2: the members swap their ``x`` and each returns ``combine(its own, the other's)``. Member 1
        sends then receives, member 0 receives then sends (never both waiting on a full socket). A sum is the
        same bits on both members (x1 + x0 is bitwise x0 + x1)."""
        if self.index == 1:
            sent = self._issued(self._send(x, 0))  # before the receive below: see the module docstring
            return self._issued(combine(mx.depends(x, sent), self._recv(x, 0)))
        received = self._recv(x, 1)
        sent = self._send(mx.depends(x, received), 1)  # after the receive: its input depends on it
        return self._issued(mx.depends(combine(x, received), sent))

    def _chain_sum(self, x: mx.array) -> mx.array:
        """T > 2: partial sums down the chain to member 0, ``(x_{T-1} + x_{T-2}) + ...``, the total back up."""
        last = self.tp - 1
        partial = x
        if self.index < last:
            partial = self._recv(x, self.index + 1) + x
        if self.index == 0:
            total = partial
        else:
            sent = self._issued(self._send(partial, self.index - 1))
            total = mx.depends(self._recv(x, self.index - 1), sent)
        if self.index < last:
            total = mx.depends(total, self._send(total, self.index + 1))
        return self._issued(total)

    def _chain_gather(self, x: mx.array) -> mx.array:
        """Every member's ``x`` stacked on a new first axis, along the chain: down to member 0, then back up."""
        last = self.tp - 1
        below = mx.expand_dims(x, 0)  # members index .. T-1
        if self.index < last:
            upper = mx.distributed.recv(
                (last - self.index, *x.shape), x.dtype, self.first + self.index + 1, group=self.world
            )
            below = mx.concatenate([below, upper])
        if self.index == 0:
            every = below
        else:
            sent = self._issued(self._send(below, self.index - 1))
            every = mx.distributed.recv(
                (self.tp, *x.shape), x.dtype, self.first + self.index - 1, group=self.world
            )
            every = mx.depends(every, sent)
        if self.index < last:
            every = mx.depends(every, self._send(every, self.index + 1))
        return self._issued(every)


class Topology:
    """One rank's place in a job of ``world.size()`` ranks with tensor-parallel groups of ``tp``."""

    def __init__(self, world: mx.distributed.Group, tp: int = 1) -> None:
        size = world.size()
        if tp < 1 or size % tp:
            raise UsageError(f"--tp {tp} does not divide the job's {size} ranks into groups")
        self.world, self.tp = world, tp
        self.rank, self.size = world.rank(), size
        self.stage, self.tp_index = self.rank // tp, self.rank % tp
        self.stages = size // tp
        self.tensor = TensorGroup(world, tp)

    @property
    def sharded(self) -> bool:
        """Whether this rank holds a slice of its stage's layers (tp > 1)."""
        return self.tp > 1

    @property
    def samples(self) -> bool:
        """Whether this rank samples the tokens (world rank 0, member 0 of stage 0)."""
        return self.rank == 0

    def send_down(self, x: mx.array, stream: mx.Stream | mx.Device | mx.DeviceType | None = None) -> mx.array:
        """Send ``x`` to the next stage (stage - 1): member 0 sends to its neighbour, the next stage's last
        member; the other members send nothing (``x`` itself comes back)."""
        if self.tp_index != 0:
            return x
        return mx.distributed.send(x, self.rank - 1, group=self.world, stream=stream)

    def recv_up(
        self, shape: tuple[int, ...], dtype: mx.Dtype, stream: mx.Stream | mx.Device | mx.DeviceType | None = None
    ) -> mx.array:
        """What the previous stage (stage + 1) sent, on every member: received from ``rank + 1`` (the
        previous stage's member 0, or this stage's next member) and passed on to ``rank - 1``."""
        received = mx.distributed.recv(shape, dtype, self.rank + 1, group=self.world, stream=stream)
        if self.tp_index == 0:
            return received
        forwarded = mx.distributed.send(received, self.rank - 1, group=self.world, stream=stream)
        return cast(mx.array, mx.depends(received, forwarded))  # mlx leaves depends() unannotated

    def recv_up_like(self, like: mx.array) -> mx.array:
        """``recv_up`` of an array shaped like ``like``."""
        return self.recv_up(tuple(like.shape), like.dtype)


def single_topology() -> Topology:
    """The topology of a lone rank (tests, tools that pipeline nothing)."""
    return Topology(mx.distributed.init(), 1)


def init_group(world_size: int) -> mx.distributed.Group:
    """The distributed group of the job; a single rank needs no backend."""
    if world_size == 1:
        # mlx.launch gives a lone rank an empty hostfile, which the ring
        # backend fails to parse even when not strict.
        os.environ.pop("MLX_HOSTFILE", None)
    group = mx.distributed.init(strict=world_size > 1)
    if group.size() != world_size:
        raise LaunchError(
            f"the job is for {world_size} ranks but mlx.launch started {group.size()}",
            hint="the hostfile and the job must list the same hosts",
        )
    return group
