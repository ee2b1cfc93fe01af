"""launch/run.py: what is refused before any rank starts, and the job the ranks get (PipelineConfig.job_spec)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from fixtures.cli import REPO
from mlxpipe.errors import ModelError
from mlxpipe.plan.shard import make_plan


def test_a_draft_with_another_tokenizer_is_refused_before_launch(models) -> None:
    from mlxpipe.launch.run import check_draft
    from mlxpipe.model.metadata import ModelMetadata

    meta = ModelMetadata(str(models["target"]), {}, (), {}, local=True)
    check_draft(str(models["draft"]), meta)  # the same tokenizer: fine
    with pytest.raises(ModelError, match=r"--draft-model .*other-vocab: its tokenizer has 257 tokens, the model's 256"):
        check_draft(str(models["other_vocab"]), meta)


def test_a_model_whose_caches_cannot_be_trimmed_is_refused_before_launch(models, tiny_models) -> None:
    from mlxpipe.launch.run import check_draft
    from mlxpipe.model.metadata import ModelMetadata

    meta = ModelMetadata(str(tiny_models["lfm2"]), {}, (), {}, local=True)
    with pytest.raises(ModelError, match=r"^--draft-model: speculative decoding trims rejected drafts from the KV "
                                         r"caches, and this model's ArraysCache cannot be trimmed$"):
        check_draft(str(models["draft"]), meta)


def test_job_spec_carries_tp_a_split_per_stage_and_a_path_per_rank(tp_llama: Path, four_macs: Path) -> None:
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.hub.client import load_metadata
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.protocol.job import JobSpec

    target = resolve_target(str(tp_llama), None, four_macs, None, None, None, 2)
    the_plan = make_plan(load_metadata(str(tp_llama)), target.hostfile.hosts, tp=2)
    if "tp" not in {f.name for f in fields(JobSpec)}:
        pytest.skip("the worker's JobSpec has no tp field yet (tp-core adds it)")
    job = PipelineConfig(target).job_spec(load_metadata(str(tp_llama)), the_plan)
    assert (job.tp, job.split, len(job.model_paths)) == (2, [3, 3], 4)  # type: ignore[attr-defined]


def test_job_spec_without_tp_is_unchanged(tp_llama: Path) -> None:
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.hub.client import load_metadata
    from mlxpipe.launch.config import PipelineConfig

    target = resolve_target(str(tp_llama), None, REPO / "hostfiles" / "local-2.json", None, None, None)
    meta_ = load_metadata(str(tp_llama))
    job = PipelineConfig(target).job_spec(meta_, make_plan(meta_, target.hostfile.hosts))
    assert (job.split, len(job.model_paths), getattr(job, "tp", 1)) == ([3, 3], 2, 1)
