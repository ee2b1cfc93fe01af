"""plan/choose.py: the feasible layouts of a model on a cluster, ranked for a workload; fewer hosts that beat one."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from fixtures.plan_inputs import meta
from mlxpipe.host import Host
from mlxpipe.model.metadata import ModelMetadata, Tensor
from mlxpipe.plan.choose import TIE, _settle_ties, candidates, fewer_hosts
from mlxpipe.plan.cluster_facts import Calibration, ClusterFacts, HostFacts, LinkFacts
from mlxpipe.plan.parallel_layout import AGENT, BATCH, CHAT

MS, US = 1e-3, 1e-6
FAST, SLOW = (10 * US, 10e9), (2 * MS, 0.1e9)  # Thunderbolt RDMA-ish; a slow hop (Wi-Fi, a busy switch)
MAC = Calibration(decode_bandwidth=100e9, prefill_flops=10e12, layer_overhead=0.0, step_overhead=0.0)


def model(layers: int = 16, heads: int = 8, kv_heads: int = 4, **config: Any) -> ModelMetadata:
    """A llama-like model: 2-D weights of 50M bf16 parameters (100 MB) a layer, a 20 MB head."""
    tensors = [Tensor(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (5000, 10000), "w.safetensors")
               for i in range(layers)]
    tensors.append(Tensor("lm_head.weight", "BF16", (1000, 10000), "w.safetensors"))
    return meta(tensors, layers, num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=10000,
                vocab_size=1000, **config)


def cluster(links: list[tuple[float, float]], collective: float = 1 * MS, memory_gb: float | None = None
            ) -> tuple[list[Host], ClusterFacts]:
    """Hosts 0..n-1 whose ring links (i, i+1), and the last back to the first, are ``links`` (one link: 2 hosts)."""
    n = len(links) if len(links) > 1 else 2
    hosts = [Host(r, f"mac{r}", memory_gb=memory_gb) for r in range(n)]
    pairs = [(r, r + 1) for r in range(n - 1)] + ([(0, n - 1)] if n > 2 else [])
    facts = ClusterFacts(tuple(HostFacts(r, f"mac{r}", "Apple M4 Max", "gpu", 546e9, "apple", 17e12, MAC)
                               for r in range(n)),
                         tuple(LinkFacts(p, lat, bw) for p, (lat, bw) in zip(pairs, links, strict=True)), "ring",
                         collective)
    return hosts, facts


def test_every_feasible_layout_is_weighed_and_equal_splits_are_one() -> None:
    hosts, facts = cluster([FAST, FAST, FAST, FAST])
    choice = candidates(model(), hosts, CHAT, facts=facts)
    names = [c.name for c in choice.candidates]
    # pipeline: balanced = even on like layers; tp 2 x 2 stages likewise; tp 4 one stage.
    assert sorted(names) == sorted(["pipeline balanced/even 4,4,4,4", "tp 2 x 2 stages balanced/even 8,8", "tp 4"])
    assert choice.refused == ()
    assert [c.estimate.score for c in choice.candidates] == sorted(c.estimate.score for c in choice.candidates)


def test_auto_puts_tensor_parallelism_on_the_fast_links_and_a_stage_boundary_on_the_slow_one() -> None:
    # Two Thunderbolt pairs (0-1, 2-3) joined by a slow link (1-2, and 3-0 closing the ring).
    hosts, facts = cluster([FAST, SLOW, FAST, SLOW], collective=4 * MS)
    choice = candidates(model(), hosts, CHAT, facts=facts)
    best = choice.chosen
    assert best.name == "tp 2 x 2 stages balanced/even 8,8"
    assert [r.stage for r in best.plan.ranks] == [0, 0, 1, 1]  # groups {0, 1} and {2, 3}: the boundary is 1-2
    tp4 = next(c for c in choice.candidates if c.layout.tp == 4)
    assert tp4.estimate.decode < best.estimate.decode / 5  # every all-reduce would cross the slow links
    assert "runner-up" in choice.reason and best.name in choice.reason


def test_auto_keeps_a_pipeline_where_every_link_is_slow() -> None:
    hosts, facts = cluster([SLOW, SLOW, SLOW, SLOW], collective=8 * MS)
    assert candidates(model(), hosts, CHAT, facts=facts).chosen.layout.tp == 1


def test_a_group_size_the_heads_refuse_is_listed_with_why() -> None:
    hosts, facts = cluster([FAST, FAST, FAST, FAST])
    choice = candidates(model(kv_heads=2), hosts, CHAT, facts=facts)
    assert {c.layout.tp for c in choice.candidates} == {1, 2}
    assert choice.refused == (("tp 4", "--tp 4: test/model has 2 KV heads (num_key_value_heads), not divisible by 4"),)


def test_a_layout_whose_ranks_do_not_fit_is_refused() -> None:
    # 16 x 100 MB on hosts of 1 GB (0.67 GB budget, 0.5 GB runtime): only tp 4 (400 MB each, 16 layers) ... none fit.
    hosts, facts = cluster([FAST, FAST, FAST, FAST], memory_gb=1)
    choice = candidates(model(), hosts, CHAT, facts=facts)
    assert choice.candidates == ()
    assert all(why == "a rank does not hold its share" for _, why in choice.refused)


def test_the_workload_decides_between_long_prompts_and_many_at_once() -> None:
    hosts, facts = cluster([FAST])
    m = model()
    chat, agent, batch = (candidates(m, hosts, w, facts=facts) for w in (CHAT, AGENT, BATCH))
    assert agent.chosen.estimate.prompt == 8000 and chat.chosen.estimate.prompt == 1000
    # Every figure is the same whatever the workload, but the score weighs them.
    for c in batch.candidates:
        assert c.estimate.score == pytest.approx(1000 / c.estimate.prefill + 250 / c.estimate.aggregate)


def test_near_ties_go_to_the_simpler_layout() -> None:
    hosts, facts = cluster([FAST])
    tp, pipe = sorted(candidates(model(), hosts, CHAT, facts=facts).candidates, key=lambda c: -c.layout.tp)
    near = replace(pipe, estimate=replace(pipe.estimate, score=tp.estimate.score * (1 + TIE / 2)))
    far = replace(pipe, estimate=replace(pipe.estimate, score=tp.estimate.score * (1 + 2 * TIE)))
    assert _settle_ties([tp, near])[0] is near  # within 1%: the pipeline, which has no all-reduce to misjudge
    assert _settle_ties([tp, far])[0] is tp


def test_fewer_hosts_finds_the_first_host_alone_when_the_links_cost_more_than_they_give() -> None:
    hosts, facts = cluster([(20 * MS, 0.01e9)], collective=40 * MS)
    m = model(layers=4)
    every = candidates(m, hosts, CHAT, facts=facts, tps=(2,))
    better = fewer_hosts(m, hosts, every.chosen, CHAT, facts=facts)
    assert better is not None and better.layout.hosts == 1
    assert better.estimate.score < every.chosen.estimate.score
    fast_hosts, fast = cluster([FAST])
    best = candidates(m, fast_hosts, CHAT, facts=fast).chosen
    assert fewer_hosts(m, fast_hosts, best, CHAT, facts=fast) is None
