"""fleet/plan.py: every entry planned over its own hosts, and the hosts shared by two entries checked against
both; fleet/ports.py: the pipelines' rings kept apart. No rank, no hub: models are metadata alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.plan_inputs import MB, uniform
from mlxpipe.cluster.hostfile import parse_hostfile
from mlxpipe.errors import FleetError
from mlxpipe.fleet.plan import plan_fleet
from mlxpipe.fleet.ports import first_ports
from mlxpipe.fleet.spec import Fleet, parse_fleet
from mlxpipe.host import GB
from mlxpipe.plan.costs import RUNTIME_OVERHEAD

# Three hosts whose GPU may use exactly 4 GiB each.
HOSTS = parse_hostfile([{"ssh": f"mini-{i}", "ips": [f"10.0.0.{i}"], "memory_gb": 8, "wired_limit_gb": 4}
                        for i in range(3)], Path("cluster.json"))
BIG = uniform(8, 512 * MB)  # 4 GiB of layers: two hosts' worth, with room for the runtime
SMALL = uniform(4, 256 * MB)  # 1 GiB


def fleet(*entries: dict[str, object]) -> Fleet:
    return parse_fleet({"models": list(entries)}, Path("fleet.yaml"), HOSTS)


def test_each_replica_is_planned_over_its_own_hosts() -> None:
    f = fleet({"model": "big", "hosts": [0, 1], "tp": 1}, {"model": "small", "hosts": [1, 2], "replicas": 2})
    plan = plan_fleet(f, {0: BIG, 1: SMALL}, context=1024)
    assert [(p.label, p.hosts, [r.host for r in p.plan.ranks], p.plan.split) for p in plan.placed] == [
        ("big", (0, 1), ["mini-0", "mini-1"], (4, 4)),
        ("small#0", (1,), ["mini-1"], (4,)),
        ("small#1", (2,), ["mini-2"], (4,)),
    ]
    assert all(p.plan.fits for p in plan.placed)


def test_a_host_in_two_entries_must_hold_both_and_says_how_much_it_lacks() -> None:
    f = fleet({"model": "big", "hosts": [0, 1]}, {"model": "small", "hosts": [1], "names": ["haiku"]})
    plan = plan_fleet(f, {0: BIG, 1: SMALL}, context=1024)
    assert all(p.plan.fits for p in plan.placed)  # each alone fits
    assert not plan.fits
    (short,) = plan.shortfalls
    big_rank, small_rank = plan.placed[0].plan.ranks[1], plan.placed[1].plan.ranks[0]
    need = sum(r.budget_bytes - r.headroom_bytes for r in (big_rank, small_rank))  # type: ignore[operator]
    assert (short.host, short.ssh, short.holders, short.budget_bytes, short.need_bytes) == (
        1, "mini-1", ("big", "haiku"), 4 * GB, need)
    # Each rank: its weights (2 GiB of the big model, 1 GiB of the small), a runtime, and its KV cache at 1,024 tokens.
    kv = need - (big_rank.weight_bytes + small_rank.weight_bytes + 2 * RUNTIME_OVERHEAD)
    assert 0 < kv < 4 * MB
    assert short.lacks_bytes == need - 4 * GB > 0
    data = plan.to_json()
    assert data["fits"] is False and data["shortfalls"][0]["holders"] == ["big", "haiku"]
    assert [p["names"] for p in data["pipelines"]] == [["big"], ["small", "haiku"]]


def test_hosts_shared_by_models_that_fit_together_pass() -> None:
    f = fleet({"model": "a", "hosts": [0]}, {"model": "b", "hosts": [0]})
    plan = plan_fleet(f, {0: SMALL, 1: SMALL}, context=1024)
    assert plan.fits and not plan.shortfalls


def test_an_entry_the_planner_refuses_is_named_with_its_file_and_entry() -> None:
    f = fleet({"model": "big", "hosts": [0, 1], "tp": 2})
    with pytest.raises(FleetError, match=r"^fleet.yaml: entry 0 \(big\): "):
        plan_fleet(f, {0: uniform(8, MB, num_attention_heads=3)}, context=1024)


def test_the_pipelines_rings_take_consecutive_ports() -> None:
    f = fleet({"model": "a", "hosts": [0, 1]}, {"model": "b", "hosts": [1, 2], "replicas": 2})
    pipelines = [f.replica_hostfile(e, r) for e in f.entries for r in range(e.replicas)]
    assert first_ports(pipelines, 6000) == [6000, 6002, 6003]
    assert first_ports(pipelines, 32323) == [32323, 32325, 32326]
