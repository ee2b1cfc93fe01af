"""protocol/job.py: the job every rank gets, encoded and checked."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict
from typing import Any

import pytest

from mlxpipe.errors import UsageError, WireError
from mlxpipe.protocol.job import JobSpec, TrainSpec

TRAIN = TrainSpec(seed=0, num_layers=2, lora_parameters={"rank": 8, "scale": 20.0, "dropout": 0.0},
                  fine_tune_type="lora", optimizer="adam", optimizer_config={}, learning_rate=1e-5, lr_schedule=None,
                  grad_checkpoint=False)


def test_job_round_trips_and_validates() -> None:
    job = JobSpec(["/a", "/b"], [2, 4], mode="native", prefill_step_size=64)
    assert JobSpec.decode(job.encode()) == job
    assert job.layer_range(0) == (4, 6) and job.layer_range(1) == (0, 4)
    with pytest.raises(UsageError):
        JobSpec(["/a"], [2, 4])
    with pytest.raises(UsageError):
        JobSpec(["/a"], [2], mode="tensor")
    with pytest.raises(UsageError):
        JobSpec.decode("not base64 json")


def test_job_with_tp_needs_a_path_per_rank_and_a_split_per_stage() -> None:
    job = JobSpec(["a", "a", "b", "b"], [2, 4], tp=2)
    assert job.world_size == 4
    assert [job.layer_range(r) for r in range(4)] == [(4, 6), (4, 6), (0, 4), (0, 4)]
    with pytest.raises(UsageError, match="3 model paths for 2 stages of 2 ranks"):
        JobSpec(["a", "a", "b"], [2, 4], tp=2)
    with pytest.raises(UsageError, match="generic pipeline only"):
        JobSpec(["a", "a"], [6], tp=2, mode="native")


def test_a_job_survives_the_command_line() -> None:
    job = JobSpec(["/a", "/a", "/b", "/b"], [2, 4], prefill_step_size=128, train=None, tp=2)
    assert JobSpec.decode(job.encode()) == job
    trained = JobSpec(["/a", "/b"], [2, 4], train=TRAIN)
    assert JobSpec.decode(trained.encode()) == trained


def _encoded(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def test_a_job_with_a_field_this_worker_does_not_know_or_lacks_is_refused() -> None:
    good = asdict(JobSpec(["/a", "/b"], [2, 4], train=TRAIN))
    with pytest.raises(WireError, match="the job has fields this worker does not know: pipeline_depth"):
        JobSpec.decode(_encoded({**good, "pipeline_depth": 2}))
    with pytest.raises(WireError, match="the job lacks the field split"):
        JobSpec.decode(_encoded({k: v for k, v in good.items() if k != "split"}))
    train = {k: v for k, v in good["train"].items() if k != "seed"}
    with pytest.raises(WireError, match="the job's train lacks the field seed"):
        JobSpec.decode(_encoded({**good, "train": train}))


@pytest.mark.parametrize("changes, error", [
    ({"mode": "magic"}, "mode 'magic': use one of generic, native"),
    ({"prefill_step_size": 0}, "prefill_step_size must be positive, got 0"),
    ({"num_draft_tokens": 0}, "num_draft_tokens must be at least 1, got 0"),
    ({"draft_paths": ["/d"]}, "job has 1 draft model paths for 2 ranks"),
    ({"split": [0, 6]}, "every rank needs at least one layer"),
])
def test_a_job_is_checked_by_the_same_rules_as_the_flags(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(UsageError, match=error):
        JobSpec(**{"model_paths": ["/a", "/b"], "split": [3, 3], **changes})


@pytest.mark.parametrize("changes, error", [
    ({"fine_tune_type": "full"}, "fine_tune_type 'full': use one of lora, dora"),
    ({"optimizer": "lion"}, "optimizer 'lion': use one of adam, adamw, muon, sgd, adafactor"),
])
def test_a_training_spec_takes_what_a_rank_can_train(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(UsageError, match=error):
        TrainSpec(**{**asdict(TRAIN), **changes})
