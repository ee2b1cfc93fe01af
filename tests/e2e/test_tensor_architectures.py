"""Every architecture the pipeline runs, at ``--tp 2``: token-identical to mlx-lm, or refused with its reason.

``tests/tensor_parallel.json`` says, per model type the pipeline runs
(``identical`` in ``tests/architectures.json``), what tensor parallelism does
with it: ``identical`` (greedy tokens of both members equal single-process
mlx-lm's, sliced by the model's own ``shard()`` or by the generic sharder, as
recorded), ``near-tie`` (a reordered sum flips a near-tie of the random tiny
model: its tokens are not compared, its logits must be within
``LOGITS_TOLERANCE`` of mlx-lm's), ``refused`` (refused before launch by
``check_pipelinable(..., tp=2)`` with the recorded one-line reason) or
``untested`` (with why). An identical architecture whose tiny model repeats
one token (``"logits": true``) has its logits compared too. One launch of 2 ranks runs every shardable
architecture (``fixtures/tp_suite.py``), with the pipeline suite's 2-stage cases
(``fixtures/arch_launches.py``); docs/tensor-parallel.md's table is
generated from the same file (``PYTHONPATH=tests python tests/fixtures/tp_suite.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fixtures import arch_launches, arch_suite, tp_suite
from mlxpipe.errors import ModelError

STATUS = tp_suite.load_status()
PIPELINED = arch_launches.PIPELINED
RUN = arch_launches.TP_RUN
IDENTICAL = arch_launches.TP_IDENTICAL
NEAR_TIE = arch_launches.TP_NEAR_TIE
LOGITS = arch_launches.TP_LOGITS
REFUSED = arch_launches.TP_REFUSED


@pytest.fixture(scope="session")
def tp_arch_run(arch_runs: arch_launches.ArchRuns):
    """The 2-rank launch over every architecture that shards (shared with the pipeline suite's 2-stage cases):
    (launch, (model type, event) -> both ranks' events)."""
    return arch_runs.tp()


def _events(run: Any, model_type: str, event: str) -> list[dict[str, Any]]:
    result, events = run
    found = events.get((model_type, event), [])
    if len(found) != tp_suite.TP:
        pytest.fail(f"no {event} for {model_type} from every rank\n{result.describe()}")
    return found


@pytest.mark.ranks
@pytest.mark.parametrize("model_type", IDENTICAL)
def test_tp2_token_identical(tp_arch_run, arch_root: Path, model_type: str) -> None:
    case = _events(tp_arch_run, model_type, "case")
    tokens = [e["turns"][0]["tokens"] for e in case]
    assert tokens[0] == tokens[1], f"the members disagree: {tokens}"
    assert tokens[0] == arch_suite.reference(arch_suite.build(model_type, arch_root))
    assert [e["sharding"] for e in case] == [STATUS[model_type]["sharding"]] * tp_suite.TP


@pytest.mark.ranks
@pytest.mark.parametrize("model_type", LOGITS)
def test_tp2_logits_within_tolerance(tp_arch_run, arch_root: Path, model_type: str) -> None:
    import mlx.core as mx

    events = _events(tp_arch_run, model_type, "logits")
    assert events[0]["logits"] == events[1]["logits"], "the members hold different logits"
    expected = tp_suite.reference_logits(arch_suite.build(model_type, arch_root))
    got = mx.array(events[0]["logits"])
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() <= tp_suite.LOGITS_TOLERANCE
    # Both members still agree on every token (they sample the same logits).
    tokens = [e["turns"][0]["tokens"] for e in _events(tp_arch_run, model_type, "case")]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("model_type", REFUSED)
def test_tp2_refused_before_launch(arch_root: Path, model_type: str) -> None:
    from mlxpipe.worker.load import check_pipelinable

    path = arch_suite.build(model_type, arch_root)
    check_pipelinable(path)  # the pipeline alone runs it
    with pytest.raises(ModelError) as error:
        check_pipelinable(path, tp=tp_suite.TP)
    assert str(error.value) == STATUS[model_type]["reason"]
    assert error.value.hint == "run it without --tp (a pipeline)"


@pytest.mark.parametrize("model_type", RUN)
def test_tp2_shardable_before_launch(arch_root: Path, model_type: str) -> None:
    """The check before launch lets through what the ranks run, and says how it will shard."""
    from mlxpipe.worker.load import build_without_weights
    from mlxpipe.worker.tensor import check_shardable

    model = build_without_weights(arch_suite.build(model_type, arch_root))
    assert check_shardable(model, tp_suite.TP) == STATUS[model_type]["sharding"]


def test_tp_status_covers_every_pipelined_architecture() -> None:
    """Every architecture the pipeline runs has a tensor-parallel status; every one that is not
    identical says why; every one that runs says how it shards."""
    assert set(STATUS) == PIPELINED, (
        "record each architecture the pipeline runs in tests/tensor_parallel.json: "
        f"missing {sorted(PIPELINED - set(STATUS))}, extra {sorted(set(STATUS) - PIPELINED)}"
    )
    for model_type, entry in STATUS.items():
        assert entry["status"] in tp_suite.STATUSES, model_type
        assert entry["status"] == "identical" or entry.get("reason"), model_type
        if entry["status"] in ("identical", "near-tie"):
            assert entry.get("sharding") in tp_suite.SHARDINGS, model_type


def test_tp_docs_table_is_generated_from_the_status_file() -> None:
    section = tp_suite.table_section(tp_suite.DOC.read_text())
    assert section == tp_suite.table(STATUS), "run: PYTHONPATH=tests python tests/fixtures/tp_suite.py"


def test_readme_counts_are_the_status_files() -> None:
    """The README's sentence on which architectures shard says what tests/tensor_parallel.json says."""
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    count = {s: sum(e["status"] == s for e in STATUS.values()) for s in tp_suite.STATUSES}
    by = {how: sum(e.get("sharding") == how and e["status"] == "identical" for e in STATUS.values())
          for how in ("own shard()", "generic")}
    expected = [f"Of the {len(STATUS)} architectures the pipeline runs, {count['identical']} shard at `--tp 2`",
                f"({by['own shard()']} with mlx-lm's own `shard()`, {by['generic']} with mlxpipe's generic sharder",
                f"{count['refused']} are refused before launch", f"{count['untested']} are not checked"]
    for phrase in expected:
        assert phrase in readme, f"README.md should say: {phrase}"


@pytest.mark.parametrize("model_type", [t for t in ("mamba", "exaone") if t in REFUSED])
def test_generate_refuses_before_any_rank_starts(arch_root: Path, model_type: str) -> None:
    """The controller says the ranks' refusal in one line, before launching anything (exit 1)."""
    from typer.testing import CliRunner

    from mlxpipe.cli import app

    hostfile = Path(__file__).resolve().parents[2] / "hostfiles" / "local-2.json"
    result = CliRunner().invoke(app, ["generate", "--model", str(arch_suite.build(model_type, arch_root)),
                                      "--hostfile", str(hostfile), "--tp", "2", "--prompt", "hi"])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"error: {STATUS[model_type]['reason']}\nhint: run it without --tp (a pipeline)\n"


def test_own_shard_reducing_inside_its_blocks_is_refused_in_a_pipeline(arch_root: Path) -> None:
    """qwen3_moe's own shard() sums its MoE block over an MLX group: with one stage that is the world's
    (fine), in a pipeline of 2 stages the ring cannot split it off, refused before launch."""
    from mlxpipe.worker.load import build_without_weights
    from mlxpipe.worker.tensor import check_shardable

    path = arch_suite.build("qwen3_moe", arch_root)
    assert check_shardable(build_without_weights(path), 2, stages=1) == "own shard()"
    with pytest.raises(ModelError, match=r"^qwen3_moe's own shard\(\) reduces in model\.layers\.\d+\.mlp over an MLX"):
        check_shardable(build_without_weights(path), 2, stages=2)
