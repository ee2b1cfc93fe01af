"""The pipeline gives exactly mlx-lm's tokens, on real ranks.

Correctness is defined against mlx-lm itself: the token ids a pipelined model
generates over 2 or 3 local ranks must equal single-process
``mlx_lm.stream_generate`` on the same checkpoint. One ``mlx.launch`` run per
rank count serves every case (see ``fixtures/ranks.py``); each parametrized
test checks one case against a reference computed in this process.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from fixtures.pipeline_reference import CHAT, MAX_TOKENS, PREFILL_STEP, QUESTION, SAMPLED, reference_tokens
from fixtures.ranks import PYTHON, LaunchResult, launch, launch_cases, local_hostfile, rank_dirs
from fixtures.tiny_models import ARCHITECTURES, EOS_ID, TinyModels
from mlxpipe.protocol.job import JobSpec

UNSEEDED = [{"prompt": QUESTION, "temp": 1.0}]

# With mlx-lm's convention rank 0 never holds layer 0. [5, 1] also leaves it
# without the first global and sliding layers, whose caches the model builds
# masks from: that is where stand-in cache bookkeeping matters.
_MASK_FROM_CACHE = {
    "mistral",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v32",
    "cohere2",
    "olmo3",
    "ministral3",
}
_OTHER_SPLITS = [[3, 3], [1, 5], [2, 4], [4, 2]]


def _split_2(i: int, arch: str) -> list[int]:
    return [5, 1] if arch in _MASK_FROM_CACHE else _OTHER_SPLITS[i % len(_OTHER_SPLITS)]


CASES_2: dict[str, dict[str, Any]] = {
    f"{arch}-{'-'.join(map(str, split))}": {"arch": arch, "split": split, "turns": CHAT}
    for i, arch in enumerate(ARCHITECTURES)
    for split in [_split_2(i, arch)]
}
CASES_2.update(
    {
        "qwen2-2-4-generic": {"arch": "qwen2", "split": [2, 4], "turns": CHAT},
        "qwen2-2-4-native": {"arch": "qwen2", "split": [2, 4], "turns": CHAT, "mode": "native"},
        "deepseek_v3-3-3-native": {
            "arch": "deepseek_v3",
            "split": [3, 3],
            "turns": CHAT[:1],
            "mode": "native",
        },
        "qwen2-sampled": {"arch": "qwen2", "split": [3, 3], "turns": SAMPLED},
    }
)
# Cases without a single-process reference: only the ranks must agree.
AGREEMENT_ONLY_2 = {"llama-unseeded": {"arch": "llama", "split": [2, 4], "turns": UNSEEDED}}
CASES_3: dict[str, dict[str, Any]] = {
    "qwen2-4-1-1": {"arch": "qwen2", "split": [4, 1, 1], "turns": CHAT},
    "gemma3_text-1-1-4": {"arch": "gemma3_text", "split": [1, 1, 4], "turns": CHAT},
    "deepseek_v3-2-2-2": {"arch": "deepseek_v3", "split": [2, 2, 2], "turns": CHAT[:1]},
    "lfm2-1-4-1": {"arch": "lfm2", "split": [1, 4, 1], "turns": CHAT},
    "gpt_oss-2-3-1": {"arch": "gpt_oss", "split": [2, 3, 1], "turns": CHAT[:1]},
    "deepseek_v32-1-2-3": {"arch": "deepseek_v32", "split": [1, 2, 3], "turns": CHAT[:1]},
    # Rank 1 holds an MLP and a MoE block: no cache at all, on a stage in the middle.
    "nemotron_h-2-2-2": {"arch": "nemotron_h", "split": [2, 2, 2], "turns": CHAT},
    "qwen3_5-2-1-3": {"arch": "qwen3_5", "split": [2, 1, 3], "turns": CHAT},
    "qwen2-2-2-2-native": {
        "arch": "qwen2",
        "split": [2, 2, 2],
        "turns": CHAT[:1],
        "mode": "native",
    },
}
CASES = {2: {**CASES_2, **AGREEMENT_ONLY_2}, 3: CASES_3}
_TIMEOUT = {2: 150.0, 3: 150.0}


def _request(turn: dict[str, Any]) -> dict[str, Any]:
    """A generate request for ``turn`` with the test's defaults."""
    return {"type": "generate", "max_tokens": MAX_TOKENS, "keep_cache": True, **turn}


@pytest.fixture(scope="session")
def case_results(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory):
    """rank count -> the driver run over all its cases, launched on first use."""
    runs: dict[int, tuple[LaunchResult, dict[tuple[str, int], dict[str, Any]]]] = {}

    def get(num_ranks: int) -> tuple[LaunchResult, dict[tuple[str, int], dict[str, Any]]]:
        if num_ranks not in runs:
            runs[num_ranks] = _run_cases(num_ranks, tiny_models, tmp_path_factory.mktemp("cases"))
        return runs[num_ranks]

    return get


def _run_cases(num_ranks: int, models: TinyModels, tmp: Path):
    """Launch the driver once for every case of ``num_ranks`` ranks."""
    cases = []
    for case_id, case in CASES[num_ranks].items():
        dirs = rank_dirs(models[case["arch"]], case["split"], tmp / case_id)
        job = JobSpec(
            model_paths=[str(d) for d in dirs],
            split=case["split"],
            mode=case.get("mode", "generic"),
            prefill_step_size=PREFILL_STEP,
        )
        turns = [_request(t) for t in case["turns"]]
        cases.append({"id": case_id, "job": asdict(job), "turns": turns})
    result = launch_cases("ranks.py", cases, num_ranks, tmp, timeout=_TIMEOUT[num_ranks])
    by_case = {(e["id"], e["rank"]): e for e in result.of("case")}
    return result, by_case


def _case(case_results, num_ranks: int, case_id: str) -> list[dict[str, Any]]:
    """Every rank's ``case`` event for ``case_id``; fails with the run's logs."""
    result, by_case = case_results(num_ranks)
    events = [by_case.get((case_id, r)) for r in range(num_ranks)]
    if any(e is None for e in events):
        pytest.fail(f"no result for {case_id} from every rank\n{result.describe()}")
    return events  # type: ignore[return-value]


def _check_case(case_results, tiny_models: TinyModels, num_ranks: int, case_id: str) -> None:
    """Every rank generated the reference tokens in every turn."""
    case = CASES[num_ranks][case_id]
    events = _case(case_results, num_ranks, case_id)
    ranks_tokens = [[t["tokens"] for t in e["turns"]] for e in events]
    assert all(t == ranks_tokens[0] for t in ranks_tokens), f"ranks disagree: {ranks_tokens}"
    expected = reference_tokens(tiny_models[case["arch"]], case["turns"])
    assert ranks_tokens[0] == expected
    start, end = events[0]["layers"]
    assert end == sum(case["split"]) and end - start == case["split"][0]


@pytest.mark.ranks
@pytest.mark.parametrize("case_id", list(CASES_2))
def test_two_ranks_match_mlx_lm(case_results, tiny_models, case_id: str) -> None:
    _check_case(case_results, tiny_models, 2, case_id)


@pytest.mark.ranks
@pytest.mark.parametrize("case_id", list(CASES_3))
def test_three_ranks_match_mlx_lm(case_results, tiny_models, case_id: str) -> None:
    _check_case(case_results, tiny_models, 3, case_id)


def test_every_architecture_is_covered_on_two_ranks() -> None:
    assert len(ARCHITECTURES) >= 12
    assert {c["arch"] for c in CASES_2.values()} == set(ARCHITECTURES)


@pytest.mark.ranks
def test_second_turn_reuses_the_prompt_cache(case_results) -> None:
    events = _case(case_results, 2, "qwen2-2-4-generic")
    first, second = events[0]["turns"]
    assert first["cached_tokens"] == 0
    # The first prompt is a prefix of the second; the reply is re-encoded as text.
    assert second["cached_tokens"] >= first["prompt_tokens"]
    assert second["prompt_tokens"] < first["prompt_tokens"] + 20


@pytest.mark.ranks
def test_generic_and_native_give_the_same_tokens(case_results) -> None:
    generic = _case(case_results, 2, "qwen2-2-4-generic")[0]["turns"]
    native = _case(case_results, 2, "qwen2-2-4-native")[0]["turns"]
    assert [t["tokens"] for t in generic] == [t["tokens"] for t in native]


@pytest.mark.ranks
def test_unseeded_sampling_agrees_across_ranks(case_results) -> None:
    events = _case(case_results, 2, "llama-unseeded")
    assert events[0]["turns"][0]["tokens"] == events[1]["turns"][0]["tokens"]
    assert len(set(events[0]["turns"][0]["tokens"])) > 1


# ------------------------------------------------------ the worker end to end


@pytest.fixture(scope="module")
def worker_run(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory):
    """``python -m mlxpipe.worker`` on 2 ranks: a chat of two turns, a sampled turn, exit."""
    tmp = tmp_path_factory.mktemp("worker")
    split = [2, 4]
    dirs = rank_dirs(tiny_models["llama"], split, tmp)
    job = JobSpec([str(d) for d in dirs], split, prefill_step_size=PREFILL_STEP)
    requests = [
        _request({"id": "a", "prompt": QUESTION}),
        _request({"id": "b", **SAMPLED[0]}),
        {"type": "exit"},
    ]
    result = launch(
        local_hostfile(2, tmp),
        [PYTHON, "-m", "mlxpipe.worker", "--job", job.encode()],
        requests=requests,
        timeout=60,
    )
    return result, requests


@pytest.mark.ranks
def test_worker_events(worker_run, tiny_models) -> None:
    result, requests = worker_run
    assert not result.of("error") and not result.timed_out, result.describe()
    loaded = sorted(result.of("loaded"), key=lambda e: e["rank"])
    assert [e["layers"] for e in loaded] == [[4, 6], [0, 4]]
    assert all(e["num_layers"] == 6 and e["load_seconds"] > 0 for e in loaded)

    expected = reference_tokens(tiny_models["llama"], [{"prompt": QUESTION}, SAMPLED[0]])
    for request, tokens in zip(requests[:-1], expected, strict=True):  # the last is exit
        done = [e for e in result.of("done") if e.get("id") == request["id"]]
        assert sorted(e["rank"] for e in done) == [0, 1]
        assert all(e["tokens"] == tokens for e in done)
        last_stage = next(e for e in done if e["rank"] == 0)  # it samples: the timing figures are its
        assert last_stage["finish_reason"] in ("stop", "length") and last_stage["ttft"] > 0
        streamed = [e for e in result.of("token") if e.get("id") == request["id"]]
        shown = [t for t in tokens if t != EOS_ID]  # the EOS is not streamed
        assert [e["token"] for e in streamed if e["token"] is not None] == shown

    assert sorted(e["rank"] for e in result.of("bye")) == [0, 1]
    assert result.returncode == 0
    # The final barrier lets both ranks leave together, without ring errors.
    assert "failed" not in result.stderr.lower(), result.stderr[-2000:]


@pytest.mark.ranks
def test_worker_on_a_single_rank(tiny_models, tmp_path: Path) -> None:
    """One host needs no pipeline (mlx.launch then passes an empty hostfile)."""
    job = JobSpec([str(tiny_models["qwen2"])], [6], prefill_step_size=PREFILL_STEP)
    result = launch(
        local_hostfile(1, tmp_path),
        [PYTHON, "-m", "mlxpipe.worker", "--job", job.encode()],
        requests=[_request({"prompt": QUESTION}), {"type": "exit"}],
        timeout=60,
    )
    assert not result.of("error") and not result.timed_out, result.describe()
    assert [e["layers"] for e in result.of("loaded")] == [[0, 6]]
    expected = reference_tokens(tiny_models["qwen2"], [{"prompt": QUESTION}])[0]
    assert [e["tokens"] for e in result.of("done")] == [expected]
    assert len(result.of("bye")) == 1


@pytest.mark.ranks
def test_worker_reports_missing_weights(tiny_models, tmp_path: Path) -> None:
    split = [3, 3]
    dirs = rank_dirs(tiny_models["qwen2"], split, tmp_path)
    # Rank 0 runs layers 3-5; drop the file holding layers 2 and 3.
    (dirs[0] / "model-00002-of-00003.safetensors").unlink()
    job = JobSpec([str(d) for d in dirs], split)
    result = launch(
        local_hostfile(2, tmp_path),
        [PYTHON, "-m", "mlxpipe.worker", "--job", job.encode()],
        requests=[{"type": "exit"}],
        timeout=60,
    )
    errors = {e["rank"]: e for e in result.of("error")}
    assert errors[0]["type"] == "ModelError", result.describe()
    assert "model.layers.3.mlp.down_proj.weight" in errors[0]["message"]
    assert str(dirs[0]) in errors[0]["message"]
    # Rank 1, waiting at the load barrier, may only report the lost peer.
    assert 1 not in errors or "peer" in errors[1]["message"]
