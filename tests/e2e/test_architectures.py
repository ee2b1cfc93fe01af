"""Every architecture of the installed mlx-lm: token-identical through the pipeline, or refused.

``tests/architectures.json`` says, per model type, what mlxpipe does with it:
``identical`` (the suite checks it at 2 and 3 ranks against single-process
mlx-lm; the 2-rank cases share one launch with ``test_tensor_architectures.py``'s,
``fixtures/arch_launches.py``), ``refused`` (``check_pipelinable`` must refuse it before launch, with
the reason written there) or ``untested`` (the suite cannot run it here, with
why). A newer mlx-lm's new architecture fails ``test_status_covers_installed_mlx_lm``
until someone runs it and records what happens. docs/architectures.md's table is
generated from the same file (``PYTHONPATH=tests python tests/fixtures/arch_suite.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures import arch_launches
from fixtures import arch_suite as suite
from mlxpipe.errors import ModelError

STATUS = suite.load_status()
INSTALLED = arch_launches.INSTALLED
IDENTICAL = arch_launches.IDENTICAL
REFUSED = arch_launches.REFUSED


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("model_type", IDENTICAL)
def test_token_identical(arch_runs, arch_root: Path, model_type: str, num_ranks: int) -> None:
    result, events = arch_runs.pipeline(num_ranks)
    case = events.get(model_type, [])
    if len(case) != num_ranks:
        pytest.fail(f"no result for {model_type} from every rank\n{result.describe()}")
    tokens = [e["turns"][0]["tokens"] for e in case]
    assert all(t == tokens[0] for t in tokens), f"ranks disagree: {tokens}"
    assert tokens[0] == suite.reference(suite.build(model_type, arch_root))
    split = suite.split_for(IDENTICAL.index(model_type), num_ranks, model_type)
    assert [e["layers"] for e in case] == [
        [sum(split[r + 1 :]), sum(split[r:])] for r in range(num_ranks)
    ]


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_before_launch(arch_root: Path, model_type: str) -> None:
    from mlxpipe.worker.load import check_pipelinable

    with pytest.raises(ModelError) as error:
        check_pipelinable(suite.build(model_type, arch_root))
    assert str(error.value) == f"mlxpipe cannot pipeline {model_type}: {STATUS[model_type]['reason']}"


def test_status_covers_installed_mlx_lm() -> None:
    """Every installed architecture has a status; every one not identical says why."""
    missing = sorted(INSTALLED - set(STATUS))
    assert not missing, (
        f"mlx-lm has new architectures {missing}: run them through tests/e2e/test_architectures.py "
        "and record each in tests/architectures.json"
    )
    for model_type, entry in STATUS.items():
        assert entry["status"] in suite.STATUSES, model_type
        assert entry["status"] == "identical" or entry.get("reason"), model_type


def test_refusals_match_the_pipeline() -> None:
    """The status file's refusals are exactly the pipeline's, with the same reasons."""
    from mlxpipe.worker.stages.layers import UNSUPPORTED_MODEL_TYPES

    refused = {t: s["reason"] for t, s in STATUS.items() if s["status"] == "refused"}
    assert refused == UNSUPPORTED_MODEL_TYPES


def test_docs_table_is_generated_from_the_status_file() -> None:
    section = suite.table_section(suite.DOC.read_text())
    assert section == suite.table(STATUS), "run: PYTHONPATH=tests python tests/fixtures/arch_suite.py"


def test_no_architecture_is_lost() -> None:
    # A floor at today's count (issue 14's goal): a regression fails here.
    assert len(IDENTICAL) >= 115, f"only {len(IDENTICAL)} architectures are token-identical"


@pytest.mark.parametrize("model_type", IDENTICAL)
def test_metadata_finds_the_blocks(arch_root: Path, model_type: str) -> None:
    """plan and download see the same blocks as the worker, from tensor names alone."""
    from mlxpipe.model.metadata import load_local, validate

    meta = load_local(suite.build(model_type, arch_root))
    validate(meta)
    assert meta.num_layers == suite.NUM_LAYERS
    assert {meta.layer_of(t) for t in meta.tensors} - {None} == set(range(suite.NUM_LAYERS))


@pytest.mark.parametrize("model_type", [t for t in ("deepseek_v41", "muse_spark") if t in REFUSED])
def test_a_refused_model_with_its_own_pipeline_points_to_native(arch_root: Path, model_type: str) -> None:
    """The generic pipeline refuses it; mlx-lm's own pipeline (--pipeline native) is let through."""
    from mlxpipe.worker.load import check_pipelinable

    path = suite.build(model_type, arch_root)
    with pytest.raises(ModelError) as error:
        check_pipelinable(path)
    assert error.value.hint == "run it with --pipeline native (mlx-lm's own pipeline for it; one request at a time)"
    check_pipelinable(path, mode="native")
