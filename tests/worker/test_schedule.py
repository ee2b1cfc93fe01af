"""Overlapped requests (``generate --prompts-file``): the schedule, the file, and exact tokens on real ranks.

Every request of an overlapped batch must generate exactly the tokens
single-process ``mlx_lm.stream_generate`` gives it alone. One ``mlx.launch``
run per rank count serves every case (``fixtures/batch_ranks.py``): each case
loads a model and runs the same batch with K = 1, 2 and 3 requests in flight,
one request per decode micro-batch, then K = 4 and 6 with B = 2 and 3 requests
per decode micro-batch (batched caches).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from fixtures.ranks import LaunchResult, PYTHON, launch_cases, rank_dirs
from fixtures.tiny_models import TinyModels
from typer.testing import CliRunner

from mlxpipe.launch.batch import InOrder, RequestResult, ResultsFile, read_prompts
from mlxpipe.cli import app
from mlxpipe.errors import UsageError
from mlxpipe.request import Request
from mlxpipe.worker.job import JobSpec
from mlxpipe.worker.schedule import MicroBatch, Schedule

PREFILL_STEP = 8  # below most prompts, so prefill runs in chunks
QUESTION = "Tell me about pipelines across several machines, please."
CONCURRENCY = [1, 2, 3]
BATCHED = [(4, 2), (6, 3)]  # (K in flight, B requests per decode micro-batch)
RUNS: list[tuple[int, int]] = [(k, 1) for k in CONCURRENCY] + BATCHED
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
DEMO_REQUESTS: list[dict[str, Any]] = [
    {"id": "france", "prompt": "What is the capital of France?", "max_tokens": 8},
    {"id": "count", "prompt": "1, 2, 3, 4,", "ignore_chat_template": True, "max_tokens": 2},
    {"id": "story", "prompt": "Once upon a time, in a land far away, there lived a",
     "ignore_chat_template": True, "max_tokens": 5},
    {"id": "hello", "prompt": "Hello", "ignore_chat_template": True, "max_tokens": 3},
]
# arch -> split on 2 ranks, on 3 ranks ([5, 1] leaves rank 0 without the layers masks are built from).
TINY_SPLITS = {
    "llama": ([2, 4], [1, 1, 4]),
    "qwen2": ([3, 3], [2, 2, 2]),
    "gemma3_text": ([5, 1], [1, 1, 4]),
    "deepseek_v3": ([5, 1], [2, 2, 2]),
}
DEMO_SPLITS = ([12, 18], [8, 12, 10])
CASES = {
    n: {**{arch: splits[n - 2] for arch, splits in TINY_SPLITS.items()}, "demo": DEMO_SPLITS[n - 2]}
    for n in (2, 3)
}
_TIMEOUT = 900.0  # one launch runs every case and run; a ceiling for a loaded machine


# ---------------------------------------------------------------- the schedule


def _simulate(prompts: list[list[int]], max_tokens: list[int], stages: int, slots: int,
              eos: int | None = None, decode_batch: int = 1) -> tuple[Schedule, list[list[tuple[int, ...]]], list[int]]:
    """Run a schedule with a fake model whose next token is 100 * request + position.

    Returns the schedule, what each request fed to the first stage in order,
    and how many requests each stage ran at each tick, summed over the stages.
    """
    sched = Schedule(prompts, max_tokens, stages=stages, slots=slots, prefill_step=3,
                     eos_ids={eos} if eos is not None else set(), decode_batch=decode_batch)
    fed: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    busy = []
    while not sched.done:
        sched.begin_tick()
        entered = sched.at(0)
        if entered is not None:
            assert len(entered.requests) <= decode_batch and len({len(r) for r in entered.rows}) == 1
            for index, row in zip(entered.requests, entered.rows):
                fed[index].append(row)
        busy.append(sum(len(b.requests) for s in range(stages) if (b := sched.at(s)) is not None))
        sampling = sched.sampling
        tokens = None
        if sampling is not None:
            tokens = [100 * i + len(sched.requests[i].generated) for i in sampling.requests]
        sched.end_tick(tokens)
        assert sched.tick < 10_000
    return sched, fed, busy


@pytest.mark.parametrize("decode_batch", [1, 2, 3])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("slots", [1, 2, 3, 4, 6])
def test_each_request_is_fed_as_generate_step_feeds_it(stages: int, slots: int, decode_batch: int) -> None:
    prompts = [list(range(1, 9)), [7], list(range(20, 25)), [3, 4], [5, 6, 7], [8]]
    max_tokens = [4, 3, 1, 5, 6, 2]
    sched, fed, _ = _simulate(prompts, max_tokens, stages, slots, decode_batch=decode_batch)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        generated = [100 * i + k for k in range(n)]
        assert sched.requests[i].generated == generated
        # Chunks of 3 for all but the last prompt token, then one token at a time.
        chunks = [tuple(prompt[j : min(j + 3, len(prompt) - 1)]) for j in range(0, len(prompt) - 1, 3)]
        singles = [(prompt[-1],)] + [(t,) for t in generated[:-1]]
        assert fed[i] == chunks + singles
        assert sched.requests[i].finish_reason == "length"


@pytest.mark.parametrize("stages", [2, 3])
def test_concurrency_equal_to_stages_keeps_every_stage_busy(stages: int) -> None:
    prompts = [[1, 2]] * 6
    _, _, busy = _simulate(prompts, [20] * 6, stages, slots=stages)
    steady = busy[stages : len(busy) // 2]
    assert steady and all(b == stages for b in steady)
    # One request at a time: one stage busy, once its prefill chunks (which stream) are through.
    _, _, alone = _simulate([[1]] * 6, [20] * 6, stages, slots=1)
    assert max(alone) == 1


@pytest.mark.parametrize("stages, decode_batch", [(2, 2), (2, 4), (3, 3)])
def test_batched_decode_keeps_every_stage_busy_with_decode_batch_requests(stages: int, decode_batch: int) -> None:
    slots = stages * decode_batch
    prompts = [[1, 2]] * (2 * slots)
    sched, _, busy = _simulate(prompts, [20] * len(prompts), stages, slots, decode_batch=decode_batch)
    steady = busy[2 * slots : len(busy) // 3]
    assert steady and all(b == stages * decode_batch for b in steady)
    assert sched.max_groups == stages
    # Unbatched, the same requests take about decode_batch times as many ticks.
    unbatched, _, _ = _simulate(prompts, [20] * len(prompts), stages, slots, decode_batch=1)
    assert unbatched.tick > 0.8 * decode_batch * sched.tick


@pytest.mark.parametrize("decode_batch", [2, 4])
@pytest.mark.parametrize("stages", [2, 3])
def test_overlap_comes_before_batching(stages: int, decode_batch: int) -> None:
    # C requests in flight, C = 1..3N: every stage busy at every tick of steady decode once C >= N,
    # groups as even as can be (sizes one apart at most) and never above decode_batch.
    for concurrency in range(1, 3 * stages + 1):
        sched = Schedule([[1, 2]] * concurrency, [40] * concurrency, stages=stages, slots=concurrency,
                         prefill_step=3, eos_ids=set(), decode_batch=decode_batch)
        stages_busy = []
        while not sched.done:
            sched.begin_tick()
            sizes = [len(g.members) for g in sched.groups.values() if g.members]
            if concurrency + 3 * stages <= sched.tick <= 60:  # steady decode: every request started, none ended
                stages_busy.append(sum(sched.at(s) is not None for s in range(stages)))
                assert sizes and max(sizes) - min(sizes) <= 1 and max(sizes) <= decode_batch, (concurrency, sizes)
                assert len(sizes) == max(min(concurrency, stages), -(-concurrency // decode_batch))
            sampling = sched.sampling
            sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
        expected = min(concurrency, stages)
        assert stages_busy and all(b == expected for b in stages_busy), (concurrency, stages_busy)
        assert [r.generated for r in sched.requests] == [[100] * 40] * concurrency


def test_groups_rebalance_when_requests_end() -> None:
    # Two stages, decode batch 4, six requests of which two end early: the groups even out again.
    lengths = [30, 30, 30, 30, 3, 3]
    sched = Schedule([[1, 2]] * 6, lengths, stages=2, slots=6, prefill_step=3, eos_ids=set(), decode_batch=4)
    late_sizes: list[list[int]] = []
    while not sched.done:
        sched.begin_tick()
        if 20 <= sched.tick <= 40:
            late_sizes.append(sorted(len(g.members) for g in sched.groups.values() if g.members))
        sampling = sched.sampling
        sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    assert late_sizes and all(sizes == [2, 2] for sizes in late_sizes[-10:]), late_sizes
    assert [len(r.generated) for r in sched.requests] == lengths


def test_requests_join_and_leave_decode_groups_as_they_come_and_end() -> None:
    sched = Schedule([[1, 2, 3, 4, 5, 6, 7], [8], [9, 10], [11]], [2, 6, 1, 4], stages=2, slots=4,
                     prefill_step=3, eos_ids=set(), decode_batch=2)
    groups_seen: list[tuple[int | None, tuple[int, ...]]] = []
    ended_groups: list[int] = []
    while not sched.done:
        sched.begin_tick()
        ended_groups += sched.ended_groups
        entered = sched.at(0)
        if entered is not None:
            groups_seen.append((entered.group, entered.requests))
            assert entered.group is not None or (len(entered.requests) == 1 and not entered.samples)
        sampling = sched.sampling
        sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    decode = [(g, r) for g, r in groups_seen if g is not None]
    assert max(len(r) for _, r in decode) == 2 and len({g for g, _ in decode}) >= 2
    # The 7-token prompt prefills in chunks, one request per micro-batch, then joins a group.
    assert sorted(r for g, r in groups_seen if g is None) == [(0,), (0,), (2,)]
    for g in {g for g, _ in decode}:  # each step's rows: the members that stayed, in order, then newcomers
        steps = [r for h, r in decode if h == g]
        for before, after in zip(steps, steps[1:]):
            kept = tuple(r for r in before if r in after)
            assert after[: len(kept)] == kept
    assert [r.generated for r in sched.requests] == [[100] * n for n in (2, 6, 1, 4)]
    # Emptied groups end (at the next tick's start, every stage done with them).
    assert all(not g.members for g in sched.groups.values())
    assert sorted(ended_groups + list(sched.groups)) == sorted({g for g, _ in decode})


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_long_prefill_does_not_freeze_the_streams_in_decode(stages: int) -> None:
    # Request 0 decodes; request 1's prompt (40 chunks of 3) arrives once it has started.
    sched = Schedule([[1, 2]], [60], stages=stages, slots=2, prefill_step=3, eos_ids=set())
    entries: list[tuple[int, MicroBatch]] = []
    while not sched.done:
        sched.begin_tick()
        if sched.tick == 2 * stages:
            sched.add(list(range(121)), 1)
        if (entered := sched.at(0)) is not None:
            entries.append((sched.tick, entered))
        sampling = sched.sampling
        sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    chunks = [t for t, e in entries if not e.samples and e.requests == (1,)]
    decode = [t for t, e in entries if e.samples and e.requests == (0,)]
    assert len(chunks) == 40
    during = [t for t in decode if chunks[0] <= t <= chunks[-1]]
    # While the long prompt prefills, request 0 still gets a token every time it is ready
    # (its token back from the last stage, plus at most one chunk ahead of it).
    assert during and all(b - a <= stages + 1 for a, b in zip(during, during[1:]))
    assert sched.requests[0].generated == [100] * 60


def test_only_requests_with_caches_of_one_kind_share_a_decode_group() -> None:
    # Requests 0, 1: plain caches; 2, 3: rotating (another kind); 4, 5: quantized (no merge).
    keys = [(None,), (None,), (64,), (64,), None, None]
    sched = Schedule([], [], stages=2, slots=6, prefill_step=3, eos_ids=set(), decode_batch=4)
    for key in keys:
        sched.add([1, 2], 6, batch_key=key)
    rows_seen = set()
    while not sched.done:
        sched.begin_tick()
        entered = sched.at(0)
        if entered is not None and entered.samples:
            rows_seen.add(entered.requests)
        sampling = sched.sampling
        sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    for rows in rows_seen:
        assert len({keys[i] for i in rows}) == 1, rows  # one kind per micro-batch
        assert len(rows) == 1 or keys[rows[0]] is not None, rows  # quantized: alone
    assert any(len(rows) == 2 for rows in rows_seen)  # the others did share
    assert [r.generated for r in sched.requests] == [[100] * 6] * 6


def test_models_whose_caches_cannot_be_batched_decode_one_request_per_micro_batch(tiny_models: TinyModels) -> None:
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.models.cache import ChunkedKVCache

    from mlxpipe.worker.batch_caches import decode_batch_for

    class Chunked(nn.Module):  # llama4's attention chunks: a cache mlx-lm cannot merge
        def make_cache(self) -> list[Any]:
            return [ChunkedKVCache(8)]

    job = JobSpec(["x"], [1])
    model, _ = load(str(tiny_models["qwen2"]))
    assert decode_batch_for(model, job, 4) == 4
    assert decode_batch_for(model, JobSpec(["x"], [1], max_kv_size=16), 3) == 3  # rotating caches merge
    assert decode_batch_for(Chunked(), job, 4) == 1
    with pytest.raises(UsageError, match="decode_batch must be at least 1"):
        decode_batch_for(model, job, 0)


def test_an_unbatchable_model_runs_one_request_per_decode_micro_batch(tiny_models: TinyModels) -> None:
    """One process (a group of one): the engine falls back to B = 1, and tokens still match mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxpipe.worker.load import load_rank
    from mlxpipe.worker.requests import Server

    class Unmergeable(KVCache):  # as a cache mlx-lm cannot batch (quantized, chunked)
        def __getattribute__(self, name: str) -> Any:
            if name == "merge":
                raise AttributeError(name)
            return super().__getattribute__(name)

    path = tiny_models["qwen2"]
    job = JobSpec([str(path)], [sum(TINY_SPLITS["qwen2"][0])], prefill_step_size=PREFILL_STEP)
    loaded = load_rank(job, mx.distributed.init())
    loaded.model.make_cache = lambda: [Unmergeable() for _ in loaded.model.layers]
    events: list[dict[str, Any]] = []
    server = Server(loaded, mx.distributed.init(), job, emit=lambda event, **fields: events.append({"event": event, **fields}))
    requests = [{"id": text, "prompt": text, "ignore_chat_template": True, "max_tokens": 4} for text in ("Hi", "Go", "Up")]
    done = server.generate_batch({"type": "batch", "requests": requests, "concurrency": 3, "decode_batch": 3})
    assert done["decode_batch"] == 1
    results = {e["id"]: e for e in events if e["event"] == "result"}
    for request in requests:
        assert results[request["id"]]["tokens"] == _reference(str(path), json.dumps(request, sort_keys=True))[0]


def test_where_the_time_goes_names_each_rank_and_hop() -> None:
    from mlxpipe.launch.timing import where_time_goes

    def spent(compute: float, recv: float) -> dict[str, float]:
        wall = 10.0
        return {"compute": compute, "send": 0.5, "recv": recv, "sync": wall - compute - recv - 0.5, "idle": 0.0,
                "wall": wall, "busy": compute / wall}

    report = where_time_goes({1: spent(3.0, 0.0), 0: spent(9.0, 0.2), 2: spent(2.0, 0.0)})
    assert [(r["rank"], r["busy"]) for r in report["ranks"]] == [(0, 0.9), (1, 0.3), (2, 0.2)]
    assert report["hops"] == [{"from": 1, "to": 0, "wait_s": 0.2}, {"from": 2, "to": 1, "wait_s": 0.0}]
    assert report["busiest_rank"] == 0
    assert where_time_goes({}) == {}


def test_a_finished_request_frees_its_slot_for_the_next() -> None:
    sched, _, _ = _simulate([[1, 2], [3, 4], [5, 6]], [6, 1, 2], stages=2, slots=2)
    first, short, waiting = sched.requests
    assert short.finished_tick is not None and waiting.admitted_tick == short.finished_tick + 1
    assert waiting.slot == short.slot != first.slot


def test_end_of_sequence_ends_a_request() -> None:
    sched, _, _ = _simulate([[1, 2], [3]], [10, 10], stages=2, slots=2, eos=101)
    assert sched.requests[1].generated == [100, 101]
    assert sched.requests[1].finish_reason == "stop"
    assert sched.requests[0].finish_reason == "length"


def test_schedule_refuses_a_missing_or_unexpected_token() -> None:
    sched = Schedule([[1]], [2], stages=1, slots=1, prefill_step=4, eos_ids=set())
    sched.begin_tick()
    with pytest.raises(ValueError, match="expected"):
        sched.end_tick(None)
    with pytest.raises(ValueError, match="1 tokens expected, got 2"):
        sched.end_tick([5, 6])
    with pytest.raises(ValueError, match="prompt token"):
        Schedule([[]], [2], stages=1, slots=1, prefill_step=4, eos_ids=set())


def test_results_are_handed_on_in_input_order() -> None:
    seen: list[Any] = []
    ordered = InOrder(lambda r: seen.append(r.id))
    for index in (2, 0, 3, 1):
        ordered.add(index, RequestResult(index, "", [], 0, 0, 0.0, 0.0, 0.0))
        if index == 0:
            assert seen == [0]
    assert seen == [0, 1, 2, 3]


# ---------------------------------------------------------------- the prompts file

DEFAULTS = Request(max_tokens=16)


def _result(id: Any) -> RequestResult:
    return RequestResult(id=id, text=f"text {id}", tokens=[1, 2], prompt_tokens=3, generation_tokens=2,
                         latency=1.0, ttft=0.5, tps=2.0, finish_reason="length")


def test_results_file_keeps_each_result_as_it_finishes_and_replaces_output_whole(tmp_path: Path) -> None:
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    out = tmp_path / "results.jsonl"
    out.write_text("old\n")
    saved = ResultsFile(out)
    saved.add(_result("b"))
    saved.add(_result("a"))
    partial = [json.loads(line)["id"] for line in (tmp_path / "results.jsonl.partial").read_text().splitlines()]
    assert partial == ["b", "a"]  # on disk at once, in the order they finished
    assert out.read_text() == "old\n"  # untouched until the batch is whole
    saved.finish([_result("a"), _result("b")])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def test_results_file_after_a_failure_keeps_what_finished(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    saved = ResultsFile(out)
    saved.add(_result(7))
    assert saved.abandon() == f"the 1 results that finished are in {out}.partial"
    assert json.loads((tmp_path / "results.jsonl.partial").read_text())["text"] == "text 7"
    assert not out.exists()
    nothing = ResultsFile(out)
    assert nothing.abandon() is None
    assert not (tmp_path / "results.jsonl.partial").exists()


def test_results_file_refuses_a_path_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "results.jsonl.partial").mkdir()
    with pytest.raises(UsageError, match=r"--output .*results.jsonl: cannot write .*results.jsonl.partial"):
        ResultsFile(tmp_path / "results.jsonl")


def test_a_plain_file_holds_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("First prompt\n\n  Second, indented\n")
    assert read_prompts(path, DEFAULTS) == [
        replace(DEFAULTS, id=1, prompt="First prompt"),
        replace(DEFAULTS, id=3, prompt="  Second, indented"),
    ]


def test_json_lines_carry_per_prompt_options(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "a", "max_tokens": 4, "temp": 0.7, "seed": 3}\n'
        '{"id": "x", "messages": [{"role": "user", "content": "b"}]}\n'
    )
    first, second = read_prompts(path, DEFAULTS)
    assert first == replace(DEFAULTS, id=1, prompt="a", max_tokens=4, temp=0.7, seed=3)
    assert second == replace(DEFAULTS, id="x", messages=[{"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a",}', "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"prompt": "a", "max_tokenz": 3}', "unknown key 'max_tokenz'"),
        ('{"prompt": "a", "messages": []}', "exactly one of 'prompt' and 'messages'"),
        ('{"max_tokens": 3}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": 3}', "'prompt' must be str, got 3"),
        ('{"prompt": "a", "max_tokens": true}', "'max_tokens' must be int, got true"),
        ('{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be at least 1"),
        ('{"prompt": "a", "top_p": 1.5}', "'top_p' must be in (0, 1], got 1.5"),
        ('{"prompt": "a", "temp": -0.5}', "'temp' must be >= 0, got -0.5"),
        ('{"messages": [{"role": "user"}]}', "'messages' must be a non-empty list"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(UsageError) as info:
        read_prompts(path, DEFAULTS)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_or_missing_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UsageError, match="no prompts"):
        read_prompts(empty, DEFAULTS)
    with pytest.raises(UsageError, match="cannot read the prompts file"):
        read_prompts(tmp_path / "missing.txt", DEFAULTS)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "x"], "give --prompt or --prompts-file, not both"),
        (["--pipeline", "native"], "--prompts-file overlaps requests with the generic pipeline"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--output", "/no/such/dir/out.jsonl"], "no directory /no/such/dir"),
    ],
)
def test_generate_refuses_bad_batch_flags(tiny_models: TinyModels, tmp_path: Path, args: list[str], message: str) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n")
    argv = ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts), *args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_batch_flags_need_a_prompts_file(tiny_models: TinyModels) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompt", "x", "--concurrency", "2"])
    assert result.exit_code == 2
    assert "--concurrency and --output go with --prompts-file" in result.output


def test_generate_names_the_bad_line_before_launching(tiny_models: TinyModels, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": 1}\n')
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts)])
    assert result.exit_code == 2
    assert f"{prompts}:2: unknown key 'temperature'" in result.output


# ---------------------------------------------------------------- real ranks


@pytest.fixture(scope="session")
def batch_runs(tiny_models: TinyModels, demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """rank count -> (the driver run over every case, {(case, rank): batch_case event})."""
    runs: dict[int, tuple[LaunchResult, dict[tuple[str, int], dict[str, Any]]]] = {}

    def get(num_ranks: int):
        if num_ranks not in runs:
            runs[num_ranks] = _run_batches(num_ranks, tiny_models, demo_model, tmp_path_factory.mktemp("batches"))
        return runs[num_ranks]

    return get


def _checkpoint(case: str, tiny_models: TinyModels, demo_model: Path) -> Path:
    return demo_model if case == "demo" else tiny_models[case]


def _requests(case: str) -> list[dict[str, Any]]:
    return DEMO_REQUESTS if case == "demo" else TINY_REQUESTS


def _run_batches(num_ranks: int, tiny_models: TinyModels, demo_model: Path, tmp: Path):
    cases = []
    for case, split in CASES[num_ranks].items():
        dirs = rank_dirs(_checkpoint(case, tiny_models, demo_model), split, tmp / case)
        job = JobSpec([str(d) for d in dirs], split, prefill_step_size=PREFILL_STEP)
        cases.append({"id": case, "job": asdict(job), "requests": _requests(case), "concurrency": RUNS})
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


@lru_cache(maxsize=None)
def _reference_model(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(path)


@lru_cache(maxsize=None)
def _reference(path: str, request_json: str) -> tuple[list[int], str]:
    """Single-process mlx-lm's tokens and text for one request, alone."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    request = json.loads(request_json)
    model, tokenizer = _reference_model(path)
    if request.get("ignore_chat_template"):
        prompt: Any = request["prompt"]  # stream_generate adds the BOS as the worker does
    else:
        messages = request.get("messages") or [{"role": "user", "content": request["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
    if "seed" in request:
        mx.random.seed(request["seed"])
    sampler = make_sampler(request.get("temp", 0.0), top_p=request.get("top_p", 0.0))
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=request["max_tokens"],
                                     sampler=sampler, prefill_step_size=PREFILL_STEP))
    return [r.token for r in responses], "".join(r.text for r in responses)


PARAMS = [(n, case, k, b) for n in (2, 3) for case in CASES[n] for k, b in RUNS]


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks, case, k, b", PARAMS,
                         ids=[f"{n}ranks-{c}-K{k}" + (f"B{b}" if b > 1 else "") for n, c, k, b in PARAMS])
def test_overlapped_requests_match_mlx_lm_alone(batch_runs, tiny_models, demo_model, num_ranks: int, case: str,
                                                k: int, b: int) -> None:
    events = _runs(batch_runs, num_ranks, case)
    results = _results(events[0], k, b)
    path = str(_checkpoint(case, tiny_models, demo_model))
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
    ticks = [_done(event, k)["ticks"] for k in CONCURRENCY]
    assert ticks[0] > max(ticks[1:])  # K above the stage count adds no throughput, only waiting


# ---------------------------------------------------------------- the command end to end

MLXPIPE = str(Path(PYTHON).parent / "mlxpipe")
REPO = Path(__file__).resolve().parents[2]


def _mlxpipe(*args: str) -> Any:
    import subprocess

    return subprocess.run([MLXPIPE, *args], capture_output=True, text=True, timeout=_TIMEOUT, cwd=REPO)


@pytest.mark.ranks
def test_prompts_file_json_gives_every_result_in_input_order(demo_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    requests = [{"prompt": "What is the capital of France?", "max_tokens": 6},
                {"id": "count", "prompt": "1, 2, 3,", "ignore_chat_template": True, "max_tokens": 3}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    out.write_text("an earlier run's results\n")
    result = _mlxpipe("generate", "--model", str(demo_model), "--prompts-file", str(prompts),
                      "--output", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in out.parent.iterdir()] == ["results.jsonl"]  # no partial left
    summary = json.loads(result.stdout)["summary"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [1, "count"]
    for request, got in zip(requests, lines):
        tokens, text = _reference(str(demo_model), json.dumps({**request, "id": got["id"]}, sort_keys=True))
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
