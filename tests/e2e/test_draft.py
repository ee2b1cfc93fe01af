"""Speculative decoding (``--draft-model``, ``--num-draft-tokens``): mlx-lm's tokens on real ranks.

The target verifies the draft's tokens in one pass through the stages; greedy output must be
token-identical to single-process mlx-lm with the same draft model, and to plain greedy decoding.
The draft here is the target's own first layers: some drafts are accepted, some rejected (caches
trimmed). One ``mlx.launch`` run of 2 local ranks serves every case (``fixtures/option_ranks.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from fixtures.cli import NOT_STARTED
from fixtures.option_reference import reference as mlx_lm_reference
from fixtures.ranks import launch_cases, rank_dirs
from fixtures.serve_process import ServeProcess, ready_server
from mlxpipe.protocol.job import JobSpec

PREFILL_STEP = 8
SPLIT = [2, 4]
QUESTION = "Tell me about pipelines across several machines, please."
LONG = "Stage after stage, token by token, the hidden state moves down the ring of hosts."
_TIMEOUT = 420.0


def _raw(**options: Any) -> dict[str, Any]:
    return {"prompt": LONG, "ignore_chat_template": True, "max_tokens": 12, **options}


def _turns(target: Path) -> list[dict[str, Any]]:
    """A chat of two turns (the second reuses the first's caches), the reply being mlx-lm's."""
    first = [{"role": "user", "content": QUESTION}]
    reply = mlx_lm_reference(target, {"messages": first, "max_tokens": 8}, prefill_step_size=PREFILL_STEP)[1]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    return [{"id": "turn1", "messages": first, "max_tokens": 8, "keep_cache": True},
            {"id": "turn2", "messages": second, "max_tokens": 8, "keep_cache": True}]


@pytest.fixture(scope="module")
def draft_runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("draft-runs")
    dirs = [str(d) for d in rank_dirs(models["target"], SPLIT, tmp / "dirs")]
    requests = [{"id": "greedy", **_raw()}, {"id": "sampled", **_raw(temp=1.0, seed=3)}, *_turns(models["target"])]
    job = {"prefill_step_size": PREFILL_STEP, "draft_paths": [str(models["draft"])] * 2}
    cases = [
        {"id": "generic", "job": asdict(JobSpec(dirs, SPLIT, **job)), "requests": requests},
        {"id": "generic-k2", "job": asdict(JobSpec(dirs, SPLIT, **job, num_draft_tokens=2)), "requests": requests[:1]},
        {"id": "self", "job": asdict(JobSpec(dirs, SPLIT, prefill_step_size=PREFILL_STEP,
                                             draft_paths=[str(models["target"])] * 2)), "requests": requests[:1]},
        {"id": "native", "job": asdict(JobSpec(dirs, SPLIT, mode="native", **job)), "requests": requests},
    ]
    result = launch_cases("option_ranks.py", cases, 2, tmp, timeout=_TIMEOUT)
    by_case = {(e["id"], e["rank"]): e for e in result.of("options_case")}
    if len(by_case) != 2 * len(cases):
        pytest.fail(f"not every case came back from every rank\n{result.describe()}")
    return {"cases": {c["id"]: c for c in cases}, "events": by_case}


def _expected(models: dict[str, Path], request: dict[str, Any], draft: str = "draft", k: int = 3) -> list[int]:
    fields = {key: v for key, v in request.items() if key not in ("id", "keep_cache")}
    return mlx_lm_reference(models["target"], fields, prefill_step_size=PREFILL_STEP, draft=models[draft],
                            num_draft_tokens=k)[0]


def _plain(models: dict[str, Path], request: dict[str, Any]) -> list[int]:
    fields = {key: v for key, v in request.items() if key not in ("id", "keep_cache")}
    return mlx_lm_reference(models["target"], fields, prefill_step_size=PREFILL_STEP)[0]


@pytest.mark.ranks
@pytest.mark.parametrize("case", ["generic", "native"])
@pytest.mark.parametrize("request_id", ["greedy", "sampled", "turn1", "turn2"])
def test_speculative_decoding_gives_mlx_lms_tokens(draft_runs, models, case: str, request_id: str) -> None:
    request = next(r for r in draft_runs["cases"][case]["requests"] if r["id"] == request_id)
    expected = _expected(models, request)
    for rank in (0, 1):  # every rank decodes the same tokens
        assert draft_runs["events"][(case, rank)]["alone"][request_id]["tokens"] == expected, f"rank {rank}"
    if request.get("temp", 0) == 0:
        assert expected == _plain(models, request), "greedy speculative decoding is greedy decoding"


@pytest.mark.ranks
@pytest.mark.parametrize("case, draft, k", [("generic-k2", "draft", 2), ("self", "target", 3)])
def test_other_draft_settings_give_greedy_tokens(draft_runs, models, case: str, draft: str, k: int) -> None:
    request = draft_runs["cases"][case]["requests"][0]
    got = draft_runs["events"][(case, 0)]["alone"]["greedy"]["tokens"]
    assert got == _expected(models, request, draft, k) == _plain(models, request)


@pytest.mark.ranks
@pytest.mark.parametrize("case", ["generic", "native"])
def test_the_ranks_decode_speculatively(draft_runs, case: str) -> None:
    """Some generated tokens were the draft's (accepted), some the target's own (drafts rejected)."""
    greedy = draft_runs["events"][(case, 0)]["alone"]["greedy"]
    assert 0 < greedy["draft_tokens"] < len(greedy["tokens"])
    self_drafted = draft_runs["events"][("self", 0)]["alone"]["greedy"]
    assert self_drafted["draft_tokens"] > greedy["draft_tokens"]  # a model drafting for itself: every draft accepted


@pytest.mark.ranks
def test_a_chat_turn_reuses_the_trimmed_caches(draft_runs) -> None:
    for case in ("generic", "native"):
        alone = draft_runs["events"][(case, 0)]["alone"]
        assert alone["turn1"]["cached_tokens"] == 0
        assert alone["turn2"]["cached_tokens"] > 0, case


def test_the_draft_drafts_some_tokens_right_and_some_wrong(models) -> None:
    """The test's draft model exercises both acceptance and rejection (else the tests above are weak)."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(models["target"]))
    draft, _ = load(str(models["draft"]))
    responses = list(stream_generate(model, tokenizer, LONG, max_tokens=12, draft_model=draft, num_draft_tokens=3))
    accepted = sum(r.from_draft for r in responses)
    assert 0 < accepted < len(responses) - 1


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_draft_flags_reach_the_jobspec_on_the_wire(models, tmp_path: Path, jobs_not_started: list[JobSpec],
                                                       command: str) -> None:
    """``--draft-model DIR --num-draft-tokens N`` of ``generate`` and ``chat`` end in the JobSpec every rank
    decodes from its command line: the draft's directory for each rank, and N (the ranks' own use of both runs in
    ``draft_runs``; the command end to end below)."""
    from typer.testing import CliRunner

    from mlxpipe.cli import app

    hostfile = tmp_path / "local-2.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    prompt = ["--prompt", "Hi"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, "--model", str(models["target"]), "--hostfile", str(hostfile), *prompt,
                                      "--draft-model", str(models["draft"]), "--num-draft-tokens", "2"], input="Hi\n\n")
    assert result.exit_code == 1 and NOT_STARTED in result.stderr, result.output
    assert [(job.draft_paths, job.num_draft_tokens) for job in jobs_not_started] == [([str(models["draft"])] * 2, 2)]


@pytest.mark.ranks
def test_the_flags_reach_the_ranks(models, hub_env) -> None:
    """``mlxpipe generate --draft-model`` end to end: mlx-lm's tokens, and how many were drafted. Given as a hub
    repo id, every host gets the whole draft from the hub before the launch and each rank loads it from its own
    host's cache. (A draft given as a directory runs end to end with ``--prompts-file`` below.)"""
    import os
    import subprocess
    import sys

    draft = "tiny/draft-for-speculation"
    commit = hub_env.add_repo(draft, models["draft"])
    args = [str(Path(sys.executable).parent / "mlxpipe"), "generate", "--model", str(models["target"]),
            "--draft-model", draft, "--num-draft-tokens", "2", "--prompt", LONG,
            "--ignore-chat-template", "--max-tokens", "12", "--prefill-step-size", str(PREFILL_STEP), "--json"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["tokens"] == _expected(models, _raw(), k=2)
    assert 0 < answer["draft_tokens"] < len(answer["tokens"])
    snapshot = Path(os.environ["HF_HOME"]) / "hub" / "models--tiny--draft-for-speculation" / "snapshots" / commit
    assert sorted(f.name for f in snapshot.iterdir()) == sorted(f.name for f in models["draft"].iterdir())


@pytest.mark.ranks
def test_a_prompts_file_runs_one_prompt_after_another_with_the_draft(models, tmp_path: Path) -> None:
    """``--prompts-file`` with ``--draft-model``: each line through speculative decoding, mlx-lm's tokens
    (sampled too: speculative sampling draws other tokens than plain sampling)."""
    import subprocess
    import sys

    lines = [_raw(), _raw(temp=1.0, seed=3), {"prompt": QUESTION, "max_tokens": 8},
             _raw(temp=1.0, seed=3, num_draft_tokens=2)]  # a line's own draft length
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = [str(Path(sys.executable).parent / "mlxpipe"), "generate", "--model", str(models["target"]),
            "--draft-model", str(models["draft"]), "--prompts-file", str(prompts),
            "--prefill-step-size", str(PREFILL_STEP), "--json"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)["results"]
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}  # the third line, templated
    assert [r["tokens"] for r in got[:3]] == [_expected(models, line) for line in (*lines[:2], chat)]
    assert _expected(models, lines[1]) != _plain(models, lines[1])
    assert got[3]["tokens"] == _expected(models, lines[3], k=2) != _expected(models, lines[3], k=3)


@pytest.fixture(scope="module")
def draft_server(models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """``mlxpipe serve --draft-model`` (2 drafted tokens a pass), once ready, for this file's serve tests."""
    with ready_server(["--model", str(models["target"]), "--draft-model", str(models["draft"]),
                       "--num-draft-tokens", "2", "--prefill-step-size", str(PREFILL_STEP)],
                      tmp_path_factory.mktemp("draft-serve-home")) as proc:
        yield proc


@pytest.mark.ranks
def test_serve_takes_a_draft_model(models, draft_server: ServeProcess) -> None:
    """``mlxpipe serve --draft-model``: requests run one at a time, as mlx_lm.server runs them with a draft;
    two sent at once each get mlx-lm's speculative reply, and the second turn of a chat reuses caches."""
    import threading

    import openai

    server = draft_server
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    questions = [QUESTION, "What is a ring of hosts?"]
    replies: dict[str, Any] = {}

    def ask(question: str) -> None:
        replies[question] = client.chat.completions.create(
            model=str(models["target"]), messages=[{"role": "user", "content": question}], max_tokens=8,
            temperature=0)

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=_TIMEOUT)
    for question in questions:
        tokens, text = mlx_lm_reference(models["target"], {"messages": [{"role": "user", "content": question}],
                                                            "max_tokens": 8}, prefill_step_size=PREFILL_STEP,
                                        draft=models["draft"], num_draft_tokens=2)
        assert replies[question].choices[0].message.content == text, question
        assert replies[question].usage.completion_tokens == len(tokens)
    history = [{"role": "user", "content": questions[1]},
               {"role": "assistant", "content": replies[questions[1]].choices[0].message.content},
               {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=str(models["target"]), messages=history, max_tokens=8,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == mlx_lm_reference(
        models["target"], {"messages": history, "max_tokens": 8}, prefill_step_size=PREFILL_STEP,
        draft=models["draft"], num_draft_tokens=2)[1]
    # Sampled, the draft shows: speculative sampling draws other tokens than plain sampling.
    fields = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temp": 1.0, "seed": 3}
    speculative = mlx_lm_reference(models["target"], fields, prefill_step_size=PREFILL_STEP,
                                   draft=models["draft"], num_draft_tokens=2)[1]
    assert speculative != mlx_lm_reference(models["target"], fields, prefill_step_size=PREFILL_STEP)[1]
    sampled = client.chat.completions.create(model=str(models["target"]), messages=fields["messages"],
                                             max_tokens=8, temperature=1.0, seed=3)
    assert sampled.choices[0].message.content == speculative
    # mlx_lm.server's body field: this request's draft length.
    shorter = client.chat.completions.create(model=str(models["target"]), messages=fields["messages"],
                                             max_tokens=8, temperature=1.0, seed=3,
                                             extra_body={"num_draft_tokens": 1})
    assert shorter.choices[0].message.content == mlx_lm_reference(
        models["target"], fields, prefill_step_size=PREFILL_STEP, draft=models["draft"], num_draft_tokens=1)[1]


_USER = [{"role": "user", "content": QUESTION}]
_CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
# What speculative decoding cannot do (it samples inside mlx-lm), through each door that can ask for it: the
# path, the body, the field the 400 names. Anthropic's Messages have no such field; Ollama's format is refused
# by every server.
DRAFT_REFUSALS = {
    "chat-response-format": ("/v1/chat/completions", {"messages": _USER, "max_tokens": 4,
                                                      "response_format": {"type": "json_object"}}, "response_format"),
    "chat-logprobs": ("/v1/chat/completions", {"messages": _USER, "max_tokens": 4, "logprobs": True,
                                               "top_logprobs": 2}, "logprobs"),
    "completions-logprobs": ("/v1/completions", {"prompt": LONG, "max_tokens": 4, "logprobs": 2}, "logprobs"),
    "responses-text-format": ("/v1/responses", {"input": QUESTION, "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "city", "schema": _CITY, "strict": True}}}, "text.format"),
}


@pytest.mark.ranks
@pytest.mark.parametrize(("path", "body", "param"), DRAFT_REFUSALS.values(), ids=DRAFT_REFUSALS.keys())
def test_serve_with_a_draft_model_refuses_what_it_cannot_do(draft_server: ServeProcess, path: str,
                                                             body: dict[str, Any], param: str) -> None:
    """Structured output and logprobs are a 400 naming the body's field in every door, before any rank sees them
    (a rank's fallback would answer a 500)."""
    response = httpx.post(f"{draft_server.base}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"'{param}' is not supported by this server: it runs a draft model (--draft-model); serve "
                   "without one for it", "type": "invalid_request_error", "param": param, "code": None}
    assert draft_server.health()["status"] == "ready"

