"""The pure training schedule: which stage runs F/B of which micro-batch, and in what order it talks."""

from __future__ import annotations

import pytest

from mlxpipe.worker.training import train_schedule as ts
from mlxpipe.worker.training.train_schedule import Action, comm_ops, max_in_flight, simulate, stage_actions


def names(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def test_1f1b_on_three_stages_warms_up_alternates_and_cools_down() -> None:
    assert names(stage_actions("1f1b", 3, 0, 4)) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert names(stage_actions("1f1b", 3, 1, 4)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert names(stage_actions("1f1b", 3, 2, 4)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    assert names(stage_actions("gpipe", 2, 0, 3)) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert names(stage_actions("gpipe", 2, 1, 3)) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_one_micro_batch_is_the_naive_schedule_whatever_the_name() -> None:
    for stage in range(3):
        assert names(stage_actions("1f1b", 3, stage, 1)) == names(stage_actions("gpipe", 3, stage, 1)) == ["F0", "B0"]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 9])
def test_every_micro_batch_runs_forward_then_backward_once_per_stage(stages: int, micro: int) -> None:
    for schedule in ts.SCHEDULES:
        for stage in range(stages):
            actions = stage_actions(schedule, stages, stage, micro)
            assert sorted(names(actions)) == sorted([f"F{i}" for i in range(micro)] + [f"B{i}" for i in range(micro)])
            for i in range(micro):
                assert names(actions).index(f"F{i}") < names(actions).index(f"B{i}")


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_1f1b_holds_at_most_the_stages_after_it_and_gpipe_holds_all(stages: int, micro: int) -> None:
    for stage in range(stages):
        assert max_in_flight(stage_actions("1f1b", stages, stage, micro)) == min(stages - stage, micro)
        assert max_in_flight(stage_actions("gpipe", stages, stage, micro)) == micro


@pytest.mark.parametrize("schedule", ts.SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 7, 8])
def test_sends_and_receives_never_deadlock_even_when_every_send_waits(schedule: str, stages: int, micro: int) -> None:
    for backward_from in range(stages):
        assert simulate(schedule, stages, micro, backward_from), (schedule, stages, micro, backward_from)


def test_the_simulator_catches_a_send_before_the_gradient_receive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``grad_first`` two neighbours would both send in the steady 1F1B phase: a deadlock."""
    real = ts.stage_actions

    def naive(*args: object, **kwargs: object) -> list[Action]:
        return [Action(a.kind, a.micro) for a in real(*args, **kwargs)]  # type: ignore[arg-type]

    monkeypatch.setattr(ts, "stage_actions", naive)
    assert not simulate("1f1b", 2, 4)


def test_stages_before_the_first_trained_one_only_run_forward() -> None:
    assert names(stage_actions("1f1b", 3, 0, 2, backward_from=1)) == ["F0", "F1"]
    assert ("send_grad", 0) not in comm_ops("1f1b", 3, 1, 2, backward_from=1)
    assert ("send_grad", 0) in comm_ops("1f1b", 3, 2, 2, backward_from=1)
    assert all(op != "recv_grad" for op, _ in comm_ops("1f1b", 3, 0, 2, backward_from=1))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        stage_actions("pipedream", 2, 0, 2)
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        stage_actions("1f1b", 2, 0, 0)
