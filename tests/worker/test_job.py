"""worker/job.py: the job every rank gets, encoded and checked."""

from __future__ import annotations

import pytest

from mlxpipe.errors import UsageError
from mlxpipe.worker.job import JobSpec


@pytest.mark.ranks
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


@pytest.mark.ranks
def test_job_with_tp_needs_a_path_per_rank_and_a_split_per_stage() -> None:
    job = JobSpec(["a", "a", "b", "b"], [2, 4], tp=2)
    assert job.world_size == 4
    assert [job.layer_range(r) for r in range(4)] == [(4, 6), (4, 6), (0, 4), (0, 4)]
    with pytest.raises(UsageError, match="3 model paths for 2 stages of 2 ranks"):
        JobSpec(["a", "a", "b"], [2, 4], tp=2)
    with pytest.raises(UsageError, match="generic pipeline only"):
        JobSpec(["a", "a"], [6], tp=2, mode="native")
