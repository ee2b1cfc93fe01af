"""launch/pipeline.py: the job the ranks get (job_spec)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from mlxpipe.plan.shard import make_plan
from tests.plan.test_tensor import REPO, four_hosts, tiny  # noqa: F401,F811 (four_hosts, tiny: fixtures)


def test_job_spec_carries_tp_a_split_per_stage_and_a_path_per_rank(tiny: Path, four_hosts: Path) -> None:
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.hub.client import load_metadata
    from mlxpipe.launch.pipeline import RunOptions, job_spec
    from mlxpipe.worker.job import JobSpec

    target = resolve_target(str(tiny), None, four_hosts, None, None, None, 2)
    the_plan = make_plan(load_metadata(str(tiny)), target.hostfile.hosts, tp=2)
    if "tp" not in {f.name for f in fields(JobSpec)}:
        pytest.skip("the worker's JobSpec has no tp field yet (tp-core adds it)")
    job = job_spec(load_metadata(str(tiny)), the_plan, target, RunOptions(tp=2))
    assert (job.tp, job.split, len(job.model_paths)) == (2, [3, 3], 4)  # type: ignore[attr-defined]


def test_job_spec_without_tp_is_unchanged(tiny: Path) -> None:
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.hub.client import load_metadata
    from mlxpipe.launch.pipeline import RunOptions, job_spec

    target = resolve_target(str(tiny), None, REPO / "hostfiles" / "local-2.json", None, None, None)
    meta_ = load_metadata(str(tiny))
    job = job_spec(meta_, make_plan(meta_, target.hostfile.hosts), target, RunOptions())
    assert (job.split, len(job.model_paths), getattr(job, "tp", 1)) == ([3, 3], 2, 1)
