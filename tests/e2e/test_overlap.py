"""Overlapped requests (``generate --prompts-file``) on real ranks: exact tokens, slots, ticks, the command end to end.

Every request of an overlapped batch must generate exactly the tokens
single-process ``mlx_lm.stream_generate`` gives it alone. One ``mlx.launch``
run per rank count serves every case (``fixtures/batch_ranks.py``): each case
loads a model and runs the same batch with K = 1, 2 and 3 requests in flight,
one request per decode micro-batch, then K = 4 and 6 with B = 2 and 3 requests
per decode micro-batch (batched caches). Three ranks run the shortest set that
still covers each path (K = 1, K = 3 above the stage count, and batched K = 6, B = 3)
on two architectures; the real tokenizer's chat template (``chat_model``) runs on two.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from fixtures.pipeline_reference import PREFILL_STEP
from fixtures.pipeline_reference import reference_model as _reference_model
from fixtures.pipeline_reference import request_reference as _reference
from fixtures.ranks import PYTHON, LaunchResult, launch_cases, rank_dirs
from fixtures.tiny_models import TINY_SPLITS, TinyModels
from mlxpipe.protocol.job import JobSpec

QUESTION = "Tell me about pipelines across several machines, please."
CONCURRENCY = [1, 2, 3]
BATCHED = [(4, 2), (6, 3)]  # (K in flight, B requests per decode micro-batch)
RUNS: list[tuple[int, int]] = [(k, 1) for k in CONCURRENCY] + BATCHED
# Three ranks (slower to start and to step, 3 busy-waiting ranks on 2 cores): one request at a time, more in
# flight than stages, and batched decode groups; K = 2 and (4, 2) repeat paths the two-rank run checks.
RUNS_3: list[tuple[int, int]] = [(1, 1), (3, 1), (6, 3)]
RUNS_BY_RANKS = {2: RUNS, 3: RUNS_3}
CONCURRENCY_BY_RANKS = {2: CONCURRENCY, 3: [k for k, b in RUNS_3 if b == 1]}
LONG_PROMPT = " ".join(f"step {i}," for i in range(40))  # ~300 byte tokens: 37 prefill chunks

# Different lengths: a long chat (9 prefill chunks), a 2-token prompt, templated
# and raw prompts, one that ends early (its slot goes to the next), one sampled.
TINY_REQUESTS: list[dict[str, Any]] = [
    {"id": "chat", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6},
    {"id": "short", "prompt": "Hi", "ignore_chat_template": True, "max_tokens": 2},
    {"id": "templated", "prompt": "Pipelines?", "max_tokens": 5},
    {"id": "raw", "prompt": "Stage after stage, token by token.", "ignore_chat_template": True, "max_tokens": 7},
    {"id": "sampled", "prompt": QUESTION, "temp": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 4},
    {"id": "long", "prompt": LONG_PROMPT, "ignore_chat_template": True, "max_tokens": 5},
    {"id": "one", "prompt": "Go", "ignore_chat_template": True, "max_tokens": 1},
]
# SmolLM2's tokenizer and chat template on tiny random weights (``chat_model``): templated chats and raw prompts.
CHAT_REQUESTS: list[dict[str, Any]] = [
    {"id": "france", "prompt": "What is the capital of France?", "max_tokens": 8},
    {"id": "count", "prompt": "1, 2, 3, 4,", "ignore_chat_template": True, "max_tokens": 2},
    {"id": "story", "prompt": "Once upon a time, in a land far away, there lived a",
     "ignore_chat_template": True, "max_tokens": 5},
    {"id": "hello", "prompt": "Hello", "ignore_chat_template": True, "max_tokens": 3},
]
CHAT_SPLIT = [3, 5]
CASES = {
    2: {**{arch: splits[0] for arch, splits in TINY_SPLITS.items()}, "chat": CHAT_SPLIT},
    # Three stages schedule requests alike whatever the model: two splits ([2, 2, 2], and [1, 1, 4] with
    # sliding-window caches); every architecture overlaps on two ranks above and runs alone on three in
    # test_pipeline.py.
    3: {arch: TINY_SPLITS[arch][1] for arch in ("qwen2", "gemma3_text")},
}
_TIMEOUT = 900.0  # one launch runs every case and run; a ceiling for a loaded machine


# ---------------------------------------------------------------- real ranks


@pytest.fixture(scope="session")
def batch_runs(tiny_models: TinyModels, chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """rank count -> (the driver run over every case, {(case, rank): batch_case event})."""
    runs: dict[int, tuple[LaunchResult, dict[tuple[str, int], dict[str, Any]]]] = {}

    def get(num_ranks: int):
        if num_ranks not in runs:
            runs[num_ranks] = _run_batches(num_ranks, tiny_models, chat_model, tmp_path_factory.mktemp("batches"))
        return runs[num_ranks]

    return get


def _checkpoint(case: str, tiny_models: TinyModels, chat_model: Path) -> Path:
    return chat_model if case == "chat" else tiny_models[case]


def _requests(case: str) -> list[dict[str, Any]]:
    return CHAT_REQUESTS if case == "chat" else TINY_REQUESTS


def _run_batches(num_ranks: int, tiny_models: TinyModels, chat_model: Path, tmp: Path):
    cases = []
    for case, split in CASES[num_ranks].items():
        dirs = rank_dirs(_checkpoint(case, tiny_models, chat_model), split, tmp / case)
        job = JobSpec([str(d) for d in dirs], split, prefill_step_size=PREFILL_STEP)
        cases.append({"id": case, "job": asdict(job), "requests": _requests(case),
                      "concurrency": RUNS_BY_RANKS[num_ranks]})
    result = launch_cases("batch_ranks.py", cases, num_ranks, tmp, timeout=_TIMEOUT)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in result.of("batch_run"):
        runs.setdefault((e["id"], e["rank"]), []).append(e)
    # A case counts once every one of its runs came back.
    return result, {(e["id"], e["rank"]): {**e, "runs": runs.get((e["id"], e["rank"]), [])}
                    for e in result.of("batch_case") if len(runs.get((e["id"], e["rank"]), [])) == e["runs"]}


def _runs(batch_runs, num_ranks: int, case: str) -> list[dict[str, Any]]:
    """Every rank's ``batch_case`` event for ``case``; fails with the run's logs."""
    result, by_case = batch_runs(num_ranks)
    events = [by_case.get((case, r)) for r in range(num_ranks)]
    if any(e is None for e in events):
        pytest.fail(f"no result for {case} from every rank\n{result.describe()}")
    return events  # type: ignore[return-value]


def _run(event: dict[str, Any], k: int, b: int = 1) -> dict[str, Any]:
    return next(r for r in event["runs"] if (r["concurrency"], r["decode_batch"]) == (k, b))


def _results(event: dict[str, Any], k: int, b: int = 1) -> dict[Any, dict[str, Any]]:
    """Rank 0's ``result`` events of the run with concurrency ``k`` and ``b`` per decode micro-batch, by request id."""
    return {e["id"]: e for e in _run(event, k, b)["events"] if e["event"] == "result"}


def _done(event: dict[str, Any], k: int, b: int = 1) -> dict[str, Any]:
    return next(e for e in _run(event, k, b)["events"] if e["event"] == "batch_done")


PARAMS = [(n, case, k, b) for n in (2, 3) for case in CASES[n] for k, b in RUNS_BY_RANKS[n]]


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks, case, k, b", PARAMS,
                         ids=[f"{n}ranks-{c}-K{k}" + (f"B{b}" if b > 1 else "") for n, c, k, b in PARAMS])
def test_overlapped_requests_match_mlx_lm_alone(batch_runs, tiny_models, chat_model, num_ranks: int, case: str,
                                                k: int, b: int) -> None:
    events = _runs(batch_runs, num_ranks, case)
    results = _results(events[0], k, b)
    path = str(_checkpoint(case, tiny_models, chat_model))
    for request in _requests(case):
        tokens, text = _reference(path, json.dumps(request, sort_keys=True))
        got = results[request["id"]]
        assert got["tokens"] == tokens, request["id"]
        assert got["text"] == text
        assert got["finish_reason"] == ("stop" if tokens[-1] in _eos(path) else "length")
    dones = [_done(e, k, b) for e in events]
    assert len({(d["ticks"], d["generation_tokens"]) for d in dones}) == 1, "ranks disagree on the schedule"
    assert all(d["decode_batch"] == b for d in dones)
    assert all(_results(e, k, b) == {} for e in events[1:]), "only rank 0 reports results"


def _eos(path: str) -> set[int]:
    return set(_reference_model(path)[1].eos_token_ids)


@pytest.mark.ranks
def test_a_finished_request_gives_its_slot_to_the_next_on_ranks(batch_runs) -> None:
    results = _results(_runs(batch_runs, 2, "llama")[0], 2)
    short, waiting = results["short"], results["templated"]
    assert waiting["slot"] == short["slot"]
    assert waiting["ticks"][0] == short["ticks"][1] + 1


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_more_requests_in_flight_take_fewer_ticks(batch_runs, num_ranks: int) -> None:
    event = _runs(batch_runs, num_ranks, "qwen2")[0]
    ticks = [_done(event, k)["ticks"] for k in CONCURRENCY_BY_RANKS[num_ranks]]
    assert ticks[0] > max(ticks[1:])  # K above the stage count adds no throughput, only waiting


# ---------------------------------------------------------------- the command end to end

MLXPIPE = str(Path(PYTHON).parent / "mlxpipe")
REPO = Path(__file__).resolve().parents[2]


def _mlxpipe(*args: str) -> Any:
    import subprocess

    return subprocess.run([MLXPIPE, *args], capture_output=True, text=True, timeout=_TIMEOUT, cwd=REPO)


@pytest.mark.ranks
def test_prompts_file_json_gives_every_result_in_input_order(chat_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    requests = [{"prompt": "What is the capital of France?", "max_tokens": 6},
                {"id": "count", "prompt": "1, 2, 3,", "ignore_chat_template": True, "max_tokens": 3}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    out.write_text("an earlier run's results\n")
    result = _mlxpipe("generate", "--model", str(chat_model), "--prompts-file", str(prompts),
                      "--output", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in out.parent.iterdir()] == ["results.jsonl"]  # no partial left
    summary = json.loads(result.stdout)["summary"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [1, "count"]
    for request, got in zip(requests, lines, strict=True):
        tokens, text = _reference(str(chat_model), json.dumps({**request, "id": got["id"]}, sort_keys=True))
        assert (got["tokens"], got["text"]) == (tokens, text)
        assert got["generation_tokens"] == len(tokens) and got["latency"] >= got["ttft"] > 0
    # Defaults: 4 requests per decode micro-batch, 2 ranks x 4 in flight.
    assert summary["requests"] == 2 and summary["concurrency"] == 8 and summary["decode_batch"] == 4
    spent = summary["time"]
    assert [r["rank"] for r in spent["ranks"]] == [0, 1]
    assert all(0 < r["busy"] <= 1 and r["compute_s"] > 0 for r in spent["ranks"])
    assert spent["hops"] == [{"from": 1, "to": 0, "wait_s": spent["ranks"][0]["recv_s"]}]
    assert summary["generation_tokens"] == sum(r["generation_tokens"] for r in lines)
    assert summary["aggregate_tps"] > 0


@pytest.mark.ranks
def test_prompts_file_prints_texts_in_order_then_the_summary(tiny_models: TinyModels, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("A long first prompt, so that it ends last.\nHi\n")
    result = _mlxpipe("generate", "--model", str(tiny_models["qwen2"]), "--prompts-file", str(prompts),
                      "--max-tokens", "3", "--concurrency", "2")
    assert result.returncode == 0, result.stderr
    headers = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("─" * 10)]
    assert headers == ["1", "2"]
    assert "2 requests, 2 at a time" in result.stderr and "aggregate" in result.stderr
    assert "where the time went" in result.stderr and "waiting for input" in result.stderr


@pytest.mark.ranks
def test_a_prompt_that_fails_on_the_ranks_ends_alone(tiny_models: TinyModels, tmp_path: Path) -> None:
    # Only the ranks know the model's vocabulary: a logit_bias beyond it fails that prompt there (it would
    # crash MLX). That prompt ends with an error; the others run and are kept; the command exits 1 naming it.
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"id": "raw", "prompt": "Hi"}, {"id": "bias", "prompt": "Hi", "logit_bias": {"100000": 1.0}},
             {"id": "raw2", "prompt": "Stage after stage"}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    output = tmp_path / "results.jsonl"
    result = _mlxpipe("generate", "--model", str(tiny_models["qwen2"]), "--prompts-file", str(prompts),
                      "--max-tokens", "3", "--output", str(output))
    assert result.returncode == 1, result.stderr
    assert ("error: 1 of 3 requests failed (bias): 'logit_bias' must map token ids (integers 0 to 319) to numbers"
            in result.stderr), result.stderr
    results = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert (results["bias"]["finish_reason"], results["bias"]["tokens"]) == ("error", [])
    assert all(results[i]["error"] is None and results[i]["tokens"] for i in ("raw", "raw2"))
