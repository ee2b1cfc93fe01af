"""plan/estimate.py: the cost model's formulas, on a hand-made model and cluster whose figures are round numbers.

Each expected figure is worked out here from the formulas docs/layout.md gives, so a change to the model
shows as a change of these sums.
"""

from __future__ import annotations

import math

import pytest

from fixtures.plan_inputs import hosts, meta
from mlxpipe.model.metadata import Tensor
from mlxpipe.plan.cluster_facts import Calibration, ClusterFacts, HostFacts, LinkFacts
from mlxpipe.plan.estimate import (
    NOMINAL,
    NOMINAL_LATENCY,
    Costing,
    Machine,
    aggregate_rate,
    chunk_sizes,
    decode_token,
    estimate,
    machine,
    network,
    prefill_seconds,
)
from mlxpipe.plan.model_work import ModelWork, model_work
from mlxpipe.plan.parallel_layout import BATCH, CHAT, Layout
from mlxpipe.plan.shard import make_plan

MS = 1e-3
# A machine whose numbers are easy: 1 GB/s, 1 GFLOP/s, 1 ms a layer, 2 ms a tick.
CAL = Calibration(decode_bandwidth=1e9, prefill_flops=1e9, layer_overhead=1 * MS, step_overhead=2 * MS)


def work(layers: int = 4, layer_bytes: int = 10_000_000, head_bytes: int = 5_000_000) -> ModelWork:
    """Layers of 10 MB read and 5 MFLOP a token (below the bandwidth: decode is bound by bytes), no KV cache."""
    return ModelWork(layer_bytes=(layer_bytes,) * layers, layer_flops=(5_000_000,) * layers,
                     attention_flops=(0,) * layers, kv=((0, None),) * layers, head_bytes=head_bytes,
                     head_flops=2_000_000, hidden=1000, activation_bytes=4, vocab=500)


def facts(n: int, latency: float = 1 * MS, bandwidth: float = 1e9, collective: float | None = 3 * MS) -> ClusterFacts:
    hosts = tuple(HostFacts(r, f"h{r}", "chip", "cpu", 2e9, "measured", 2e9, CAL) for r in range(n))
    pairs = [(r, r + 1) for r in range(n - 1)] + ([(0, n - 1)] if n > 2 else [])
    return ClusterFacts(hosts, tuple(LinkFacts(p, latency, bandwidth) for p in pairs), "ring", collective)


def costing(n: int, **kw: float) -> Costing:
    return Costing(work(), facts(n, **kw), "ring", decode_batch=4)


# --- one host ------------------------------------------------------------------------------------


def test_a_lone_host_decodes_at_its_layers_bytes_over_bandwidth_plus_their_overhead() -> None:
    seconds, parts = decode_token(costing(1), Layout(1, (4,), "even", 1), context=0)
    # 4 layers x (10 MB / 1 GB/s + 1 ms) + the head (5 MB / 1 GB/s): no tick, no collective (mlx-lm's own loop).
    assert seconds == pytest.approx(4 * (10 * MS + 1 * MS) + 5 * MS)
    assert parts == {"compute": pytest.approx(seconds)}


def test_a_layer_is_bound_by_its_bytes_or_its_flops_whichever_is_slower() -> None:
    m = Machine(bandwidth=1e9, compute=1e9, layer_overhead=0.0)
    assert m.layer(nbytes=10e6, flops=1e6) == pytest.approx(10 * MS)
    assert m.layer(nbytes=1e6, flops=10e6) == pytest.approx(10 * MS)


def test_machine_takes_the_calibration_else_the_published_bandwidth_at_the_assumed_efficiency() -> None:
    host = HostFacts(0, "h", "Apple M2 Ultra", "gpu", 800e9, "apple", 20e12)
    assert machine(host) == Machine(800e9 * 0.75, 20e12 * 0.6)
    assert machine(HostFacts(0, "h", "c", "cpu", 1, "m", 1, CAL)) == Machine(1e9, 1e9, 1 * MS, 2 * MS)
    assert machine(None) is NOMINAL


# --- a pipeline ---------------------------------------------------------------------------------


def test_a_pipeline_token_crosses_every_stage_one_tick_each() -> None:
    seconds, parts = decode_token(costing(2), Layout(1, (2, 2), "even", 2), context=0)
    layers = 4 * 11 * MS + 5 * MS  # every layer once, the head on stage 0
    hop = 1 * MS + 4000 / 1e9  # stage 1 -> stage 0: latency + the hidden state (1000 float32)
    ticks = 2 * (3 * MS + 2 * MS)  # two ticks: the collective and the engine's overhead each
    assert seconds == pytest.approx(layers + hop + ticks)
    assert parts["compute"] == pytest.approx(layers)
    assert parts["links"] == pytest.approx(hop + 2 * 3 * MS)
    assert parts["engine"] == pytest.approx(2 * 2 * MS)


def test_tensor_parallelism_halves_the_layers_and_adds_two_all_reduces_per_layer() -> None:
    seconds, _ = decode_token(costing(2), Layout(2, (4,), "even", 2), context=0)
    swap = 2 * (1 * MS + 4000 / 1e9)  # 2 members swap their partial sums: member 1's, then member 0's: a round trip
    per_layer = 10e6 / 2 / 1e9 + 1 * MS + 2 * swap
    head = 2.5 * MS + 2 * (1 * MS + 500 * 4 / 2 / 1e9)  # half the head, then its logits gathered (a swap of halves)
    assert seconds == pytest.approx(4 * per_layer + head + 3 * MS + 2 * MS)  # one tick


def test_added_latency_costs_tensor_parallelism_far_more_than_a_pipeline() -> None:
    pipe, tp = Layout(1, (2, 2), "even", 2), Layout(2, (4,), "even", 2)
    fast, slow = costing(2, latency=50e-6, collective=100e-6), costing(2, latency=5 * MS, collective=10 * MS)
    assert decode_token(fast, tp, 0)[0] < decode_token(fast, pipe, 0)[0]
    assert decode_token(slow, tp, 0)[0] > decode_token(slow, pipe, 0)[0]
    # Per token: 8 all-reduces and the head's gather, each a round trip of 10 ms more, and the collective under tp.
    assert decode_token(slow, tp, 0)[0] - decode_token(fast, tp, 0)[0] == pytest.approx(
        9 * 2 * (5 * MS - 50e-6) + (10 * MS - 100e-6))


def test_a_group_of_more_than_two_passes_its_sums_down_its_chain_and_back() -> None:
    c = Costing(work(layers=2), facts(8), "ring")
    four_by_two = decode_token(c, Layout(4, (1, 1), "even", 8), 0)[0]
    chain = 2 * 3 * (1 * MS + 4000 / 1e9)  # 3 links down, 3 back up
    stage = 10e6 / 4 / 1e9 + 1 * MS + 2 * chain
    head = 5e6 / 4 / 1e9 + 2 * 3 * (1 * MS + 500 * 4 / 4 / 1e9)
    hop = 4 * (1 * MS + 4000 / 1e9)  # to the next group's last member, then down its chain of 4
    ticks = 2 * (3 * MS + 2 * MS)
    assert four_by_two == pytest.approx(2 * stage + head + hop + ticks)


# --- prefill ---------------------------------------------------------------------------------------


def test_chunks_cover_every_prompt_token_but_the_last() -> None:
    assert chunk_sizes(600 - 1, 128) == [128, 128, 128, 128, 87]
    assert chunk_sizes(0, 128) == []


def test_a_prompts_chunks_follow_each_other_through_the_stages_one_tick_each() -> None:
    c = Costing(work(), facts(2, collective=0.0))
    layout = Layout(1, (2, 2), "even", 2)
    # A 257-token prompt: chunks of 128 and 128, then the last token (a decode step through both stages).
    # A chunk on a stage: 2 layers x (128 x 5 MFLOP / 1 GFLOP/s + 1 ms) = 1.282 s, bound by FLOPs; the hop
    # carries its 128 hidden states. Ticks: [stage 1: chunk 1], [both: chunk 2 on 1, chunk 1 on 0], [stage 0: chunk 2].
    chunk = 2 * (128 * 5e6 / 1e9 + 1 * MS)
    hop = 1 * MS + 128 * 4000 / 1e9
    ticks = (chunk + hop) + (chunk + hop) + chunk + 3 * 2 * MS
    last, _ = decode_token(c, layout, 257)
    assert prefill_seconds(c, layout, 257) == pytest.approx(ticks + last)


def test_the_head_runs_on_a_prompts_last_token_only() -> None:
    small, big = Costing(work(head_bytes=1), facts(2)), Costing(work(head_bytes=10**9), facts(2))
    layout = Layout(1, (2, 2), "even", 2)
    # A 1 GB head takes 1 s, where a 1-byte one is bound by its 2 MFLOP (2 ms): once, in the last token's decode
    # step, never in the chunks.
    assert prefill_seconds(big, layout, 600) - prefill_seconds(small, layout, 600) == pytest.approx(1.0 - 2 * MS)


def test_a_long_prompt_is_predicted_slower_on_the_split_balanced_for_a_batch_than_on_the_even_one() -> None:
    # bench/bench_layout.py's model: 12 float32 layers of hidden 512 and a 151,936-token head worth ~35 of them in
    # bytes. For many requests at once --strategy balanced weighs the head on every generated token and gives its
    # stage (rank 0) few layers; a long prompt, which runs the head once, then goes at the pace of the other stage.
    layers = [Tensor(f"model.layers.{i}.mlp.down_proj.weight", "F32", (512, 4352), "w.safetensors")
              for i in range(12)]
    head = Tensor("lm_head.weight", "F32", (151936, 512), "w.safetensors")
    m = meta([*layers, head], 12, hidden_size=512, vocab_size=151936, torch_dtype="float32")
    even = make_plan(m, hosts(2), strategy="even").split
    balanced = make_plan(m, hosts(2), strategy="balanced", workload=BATCH).split
    assert even == (6, 6) and balanced[0] < 4, balanced
    c = Costing(model_work(m), facts(2, latency=50e-6, collective=100e-6), "ring", decode_batch=4)
    prefill = {split: estimate(c, Layout(1, split, "split", 2), BATCH, prompt=600).prefill
               for split in (even, balanced)}
    assert prefill[even] > prefill[balanced], prefill


# --- many requests at once ---------------------------------------------------------------------------


def test_as_many_decode_groups_as_stages_keep_every_stage_busy() -> None:
    c = costing(2)
    layout = Layout(1, (2, 2), "even", 2)
    # 8 requests in groups of 4: 2 groups for 2 stages, one group's 4 tokens each tick. A stage's step on 4 rows:
    # its 2 layers bound by FLOPs (4 x 5 MFLOP = 20 ms) not bytes (10 ms), the head on stage 0 (5 ms; 8 MFLOP).
    stage0 = 2 * (20 * MS + 1 * MS) + 8 * MS
    hop = 1 * MS + 4 * 4000 / 1e9
    tick = max(stage0, 2 * 21 * MS + hop) + 3 * MS + 2 * MS
    assert aggregate_rate(c, layout, 8, context=0) == pytest.approx(4 / tick)
    # One group for two stages: every other tick yields its tokens.
    assert aggregate_rate(c, layout, 4, context=0) == pytest.approx(0.5 * 4 / tick)


def test_estimate_scores_a_request_by_its_workload() -> None:
    c = costing(2)
    layout = Layout(1, (2, 2), "even", 2)
    chat, batch = estimate(c, layout, CHAT), estimate(c, layout, BATCH)
    assert chat.score == pytest.approx(1000 / chat.prefill + 250 / chat.decode)
    assert batch.score == pytest.approx(1000 / batch.prefill + 250 / batch.aggregate)
    assert chat.concurrency == batch.concurrency == 8  # 2 hosts x the default decode batch, for every layout


# --- the network without measurements ------------------------------------------------------------------


def test_unmeasured_links_are_the_backends_nominal_ones_and_the_collective_is_modelled() -> None:
    net = network(None, 3, "jaccl")
    assert net.link(0, 2) == (NOMINAL_LATENCY["jaccl"], 1e9)
    assert net.collective == pytest.approx(2 * 2 * NOMINAL_LATENCY["jaccl"])
    assert network(None, 1, "ring").collective == 0.0


def test_the_measured_collective_is_used_for_the_whole_hostfile_only() -> None:
    f = facts(4, latency=1 * MS, collective=7 * MS)
    assert network(f, 4, "ring").collective == 7 * MS
    assert network(f, 2, "ring").collective == pytest.approx(2 * 1 * MS)  # 2 ranks: 2 steps of their link


def test_every_figure_is_finite_and_positive_on_the_nominal_host() -> None:
    c = Costing(work(), None)
    for layout in (Layout(1, (4,), "even", 1), Layout(1, (2, 2), "even", 2), Layout(2, (4,), "even", 2)):
        e = estimate(c, layout, CHAT)
        assert all(math.isfinite(x) and x > 0 for x in (e.decode, e.prefill, e.aggregate, e.score))
