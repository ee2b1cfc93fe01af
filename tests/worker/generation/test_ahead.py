"""worker/generation/ahead.py: when a decode step may be built a tick ahead, and how it is taken back."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxpipe.protocol.request import Request
from mlxpipe.worker.generation.ahead import RunAhead, lazy_sampling, may_run_ahead
from mlxpipe.worker.generation.schedule import MicroBatch, Schedule


def decoding(prompts: int, slots: int, max_tokens: int = 10) -> tuple[Schedule, MicroBatch]:
    """A one-stage schedule run until a decode step of every request in a slot enters; that step."""
    schedule = Schedule([[1, 2]] * prompts, [max_tokens] * prompts, stages=1, slots=slots, prefill_step=4,
                        eos_ids=set(), decode_batch=slots)
    while True:
        schedule.begin_tick()
        batch = schedule.at(0)
        if batch is not None and batch.samples and batch.group is not None and len(batch.requests) == slots:
            return schedule, batch
        sampling = schedule.sampling
        schedule.end_tick([7] * len(sampling.requests) if sampling is not None else None)
        assert schedule.tick < 100


@pytest.mark.parametrize(("changes", "lazy"), [
    ({}, True),
    ({"temp": 0.7}, False),  # a sampler draws on the host
    ({"logprobs": True}, False),
    ({"response_format": {"type": "json_object"}}, False),  # a grammar reads each token
    ({"kv_bits": 4}, False),
])
def test_only_greedy_requests_without_host_side_state_stay_lazy(changes: dict[str, object], lazy: bool) -> None:
    assert lazy_sampling(replace(Request(prompt="x"), **changes), has_processors=False) is lazy
    assert lazy_sampling(Request(prompt="x"), has_processors=True) is False  # logits processors too


def test_the_group_that_runs_next_may_run_ahead_on_caches_that_step_back() -> None:
    schedule, batch = decoding(prompts=2, slots=2)
    assert may_run_ahead(schedule, batch, [KVCache()])
    assert not may_run_ahead(schedule, batch, [RotatingKVCache(max_size=8)])  # its trim(1) is not exact


def test_not_when_a_member_ends_with_this_token_or_is_cancelled() -> None:
    schedule, batch = decoding(prompts=2, slots=2, max_tokens=1)  # the token this step samples is their last
    assert not may_run_ahead(schedule, batch, [KVCache()])
    schedule, batch = decoding(prompts=2, slots=2)
    schedule.cancel(batch.requests[0])
    assert not may_run_ahead(schedule, batch, [KVCache()])


def test_not_when_a_waiting_request_takes_a_slot_next() -> None:
    schedule, batch = decoding(prompts=3, slots=2)  # the third waits, but no slot is free: it does not start next
    assert may_run_ahead(schedule, batch, [KVCache()])
    schedule.slots[schedule.slots.index(batch.requests[1])] = None  # as when a member has just ended
    assert schedule.admits_next and not may_run_ahead(schedule, batch, [KVCache()])


def test_a_step_run_ahead_is_recognised_and_taken_back() -> None:
    cache = KVCache()
    kv = mx.ones((1, 2, 5, 8))
    cache.update_and_fetch(kv, kv)
    step = RunAhead(requests=(0, 1), group=3, shared=mx.array([7, 7]), cache=[cache])
    assert step.runs(MicroBatch(requests=(0, 1), rows=((7,), (7,)), samples=True, group=3))
    assert not step.runs(MicroBatch(requests=(0,), rows=((7,),), samples=True, group=3))
    assert not step.runs(None)
    step.undo()
    assert cache.offset == 4  # the token it added is forgotten
