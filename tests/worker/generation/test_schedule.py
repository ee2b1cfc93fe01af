"""worker/generation/schedule.py, pure: who runs what at each tick, with a fake model (no MLX, no ranks)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from mlxpipe.worker.generation.schedule import FAILED, MicroBatch, Schedule


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
            for index, row in zip(entered.requests, entered.rows, strict=True):
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
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
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
        for before, after in pairwise(steps):
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
    assert during and all(b - a <= stages + 1 for a, b in pairwise(during))
    assert sched.requests[0].generated == [100] * 60


@pytest.mark.parametrize("stages", [1, 2])
def test_while_a_request_decodes_another_prefills_in_chunks_of_the_budget(stages: int) -> None:
    """``prefill_budget`` 4 and ``prefill_step`` 16: request 1's 61-token prompt is cut into chunks of 4 while
    request 0 decodes, and of 16 once it has ended; request 0's tokens come as before."""
    sched = Schedule([[1, 2]], [12], stages=stages, slots=2, prefill_step=16, eos_ids=set(), prefill_budget=4)
    chunks: list[tuple[int, bool]] = []  # each chunk of request 1: its tokens, whether request 0 still decoded
    while not sched.done:
        sched.begin_tick()
        if sched.tick == 2 * stages:
            sched.add(list(range(61)), 1)
        entered = sched.at(0)
        if entered is not None and not entered.samples and entered.requests == (1,):
            chunks.append((entered.width, sched.requests[0].finish_reason is None))
        sampling = sched.sampling
        sched.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    assert sum(width for width, _ in chunks) == 60  # all but the prompt's last token
    during = [width for width, decoding in chunks if decoding]
    assert len(during) >= 3 and set(during) == {4}
    after = [width for width, decoding in chunks if not decoding]
    assert after and max(after) == 16  # full chunks again once it has ended
    assert sched.requests[0].generated == [100] * 12
    alone = Schedule([list(range(61))], [1], stages=stages, slots=2, prefill_step=16, eos_ids=set(), prefill_budget=4)
    widths = []
    while not alone.done:
        alone.begin_tick()
        if (entered := alone.at(0)) is not None and not entered.samples:
            widths.append(entered.width)
        sampling = alone.sampling
        alone.end_tick([100] * len(sampling.requests) if sampling is not None else None)
    assert widths == [16, 16, 16, 12]  # alone: the full chunks


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


def test_one_place_says_why_a_request_ends_with_its_next_token() -> None:
    sched = Schedule([[1], [2]], [2, 2], stages=1, slots=2, prefill_step=4, eos_ids={9})
    sched.add([3], 2, extra_eos=[8])
    first, _, own_eos = sched.requests
    assert [sched.end_reason(first, t) for t in (5, 9, 8, FAILED, None)] == [None, "stop", None, "error", None]
    assert sched.end_reason(own_eos, 8) == "stop"  # its own end-of-sequence id
    first.generated.append(5)
    assert sched.end_reason(first, 5) == "length" and sched.end_reason(first, None) == "length"  # its 2nd of 2
    assert sched.end_reason(first, 9) == "stop"  # the end of sequence says why first
    sched.cancel(1)
    assert sched.end_reason(sched.requests[1], FAILED) == "cancelled"


def test_schedule_refuses_a_missing_or_unexpected_token() -> None:
    sched = Schedule([[1]], [2], stages=1, slots=1, prefill_step=4, eos_ids=set())
    sched.begin_tick()
    with pytest.raises(ValueError, match="expected"):
        sched.end_tick(None)
    with pytest.raises(ValueError, match="1 tokens expected, got 2"):
        sched.end_tick([5, 6])
    with pytest.raises(ValueError, match="prompt token"):
        Schedule([[]], [2], stages=1, slots=1, prefill_step=4, eos_ids=set())
