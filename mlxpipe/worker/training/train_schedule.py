"""Which micro-batch each pipeline stage runs forward (F) or backward (B), in what order.

Pure: no MLX, no ranks. Stages count from the model's input: stage 0 runs the
first layers (the highest rank, mlx-lm's convention) and stage S-1 the last
layers, the head and the loss (rank 0).

* ``gpipe``: every forward, then every backward; a stage holds all M
  micro-batches' activations at once.
* ``1f1b``: stage s runs ``S - 1 - s`` warm-up forwards, then alternates one
  forward and one backward, then cools down with the remaining backwards, so it
  never holds more than ``S - s`` micro-batches' activations (PipeDream-flush,
  as in Megatron-LM and ``torch.distributed.pipelining``).

Sends and receives block until the peer takes part (large tensors), so their
order matters as much as the computation's: ``comm_ops`` lists each stage's
in the order the rank runs them, and ``simulate`` checks that every stage's
list completes against its neighbours'. In the steady 1F1B phase a forward
receives the gradient of the backward that follows it *before* sending its own
output downstream; otherwise two neighbours would both be sending.

Stages before ``backward_from`` run no backward at all (no trainable
parameters there nor before them): they only forward, and nobody sends them
gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work on one micro-batch.

    ``kind`` is ``"F"`` or ``"B"``. For an F, ``grad_first`` names the
    micro-batch whose output gradient the stage receives after computing this
    forward and before sending its output (the backward that comes next).
    """

    kind: str
    micro: int
    grad_first: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def check(schedule: str, num_stages: int, micro_batches: int) -> None:
    """Raise ValueError for a schedule that cannot be built."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")


def stage_actions(
    schedule: str, num_stages: int, stage: int, micro_batches: int, backward_from: int = 0
) -> list[Action]:
    """Stage ``stage``'s actions for one training step, in order."""
    check(schedule, num_stages, micro_batches)
    m = micro_batches
    if stage < backward_from:
        return [Action("F", i) for i in range(m)]
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    warmup = min(num_stages - 1 - stage, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action("F", warmup + i, grad_first=i))
        actions.append(Action("B", i))
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def comm_ops(
    schedule: str, num_stages: int, stage: int, micro_batches: int, backward_from: int = 0
) -> list[tuple[str, int]]:
    """The sends and receives ``stage`` runs, in order: ``(op, micro)`` with op one of
    ``recv_act`` (from stage - 1), ``send_act`` (to stage + 1), ``recv_grad`` (from
    stage + 1), ``send_grad`` (to stage - 1)."""
    first, last = stage == 0, stage == num_stages - 1
    sends_grad = not first and stage > backward_from  # the stage before it runs a backward
    ops: list[tuple[str, int]] = []
    for a in stage_actions(schedule, num_stages, stage, micro_batches, backward_from):
        if a.kind == "F":
            if not first:
                ops.append(("recv_act", a.micro))
            if a.grad_first is not None and not last:
                ops.append(("recv_grad", a.grad_first))
            if not last:
                ops.append(("send_act", a.micro))
        else:
            if not last and a.micro not in {m for op, m in ops if op == "recv_grad"}:
                ops.append(("recv_grad", a.micro))
            if sends_grad:
                ops.append(("send_grad", a.micro))
    return ops


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches that have run forward but not yet backward, at any point."""
    held, most = set(), 0
    for a in actions:
        if a.kind == "F":
            held.add(a.micro)
        else:
            held.discard(a.micro)
        most = max(most, len(held))
    return most


def simulate(schedule: str, num_stages: int, micro_batches: int, backward_from: int = 0) -> bool:
    """Whether every stage's ``comm_ops`` complete when each send waits for its receive.

    Each message goes between neighbours in order (one stream per direction), so
    a receive must meet the send of the same micro-batch.
    """
    ops = [comm_ops(schedule, num_stages, s, micro_batches, backward_from) for s in range(num_stages)]
    pos = [0] * num_stages
    peer = {"send_act": (1, "recv_act"), "send_grad": (-1, "recv_grad")}
    while True:
        moved = False
        for s in range(num_stages):
            if pos[s] >= len(ops[s]) or ops[s][pos[s]][0] not in peer:
                continue
            op, micro = ops[s][pos[s]]
            step, wanted = peer[op]
            t = s + step
            if pos[t] < len(ops[t]) and ops[t][pos[t]][0] == wanted:
                if ops[t][pos[t]][1] != micro:
                    return False  # the receiver expects another micro-batch: wrong data
                pos[s] += 1
                pos[t] += 1
                moved = True
        if not moved:
            return all(p == len(o) for p, o in zip(pos, ops, strict=True))
