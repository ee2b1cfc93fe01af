"""cluster/links.py's controller side without ranks: where the facts live, when they are used, the ring's pairs,
a machine's published bandwidth. The links job itself runs on real ranks in tests/e2e/test_layout.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.cluster_facts import FACTS
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.cluster.links import facts_path, host_facts_of, load_facts, measure, ring_pairs, write_facts
from mlxpipe.errors import UsageError
from mlxpipe.protocol.events import HostMeasured


def hostfile(tmp_path: Path, *ips: str, name: str = "cluster.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"hosts": [{"ssh": ssh, "ips": [ip]} for ssh, ip in zip("ab", ips, strict=True)]}))
    return path


def test_the_facts_live_beside_their_hostfile() -> None:
    assert facts_path(Path("/x/cluster.json")) == Path("/x/cluster.facts.json")
    assert facts_path(Path("ring.yaml")) == Path("ring.facts.json")


def test_facts_are_used_for_the_hosts_they_were_measured_on_only(tmp_path: Path) -> None:
    path = hostfile(tmp_path, "10.0.0.1", "10.0.0.2")
    assert load_facts(load_hostfile(path)) == (None, "no cluster.facts.json beside cluster.json: links not measured")
    write_facts(FACTS, path)
    assert load_facts(load_hostfile(path)) == (FACTS, None)
    moved = hostfile(tmp_path, "10.0.0.1", "10.0.0.9")
    assert load_facts(load_hostfile(moved)) == (
        None, f"{facts_path(moved)} is of other hosts than cluster.json lists now: measure again")
    facts_path(moved).write_text("{")
    assert load_facts(load_hostfile(moved))[1].startswith(f"{facts_path(moved)}: ")  # type: ignore[union-attr]


@pytest.mark.parametrize(("size", "pairs"), [(1, []), (2, [(0, 1)]), (3, [(0, 1), (1, 2), (0, 2)]),
                                             (4, [(0, 1), (1, 2), (2, 3), (0, 3)])])
def test_the_pairs_mlxs_ring_exchanges_data_between(size: int, pairs: list[tuple[int, int]]) -> None:
    assert ring_pairs(size) == pairs


def test_a_listed_chip_gets_apples_bandwidth_and_any_other_its_measured_one() -> None:
    event = HostMeasured(rank=1, host="m", chip="Apple M2 Ultra", performance_cores=16, device="gpu",
                         memory_bandwidth=650e9, compute=2e13, dtype="float16")
    mac = host_facts_of(event, "studio-2")
    assert (mac.rank, mac.ssh, mac.memory_bandwidth) == (1, "studio-2", 800e9)
    assert mac.memory_bandwidth_source.startswith("https://www.apple.com/newsroom/")
    cpu = host_facts_of(HostMeasured(rank=0, host="x", chip="AMD EPYC", performance_cores=None, device="cpu",
                                     memory_bandwidth=5e9, compute=3e9, dtype="float32",
                                     calibration={"decode_bandwidth": 4e9, "prefill_flops": 6e9,
                                                  "layer_overhead": 1e-4, "step_overhead": 5e-5}), "x")
    assert (cpu.memory_bandwidth, cpu.memory_bandwidth_source) == (5e9, "measured")
    assert cpu.calibration is not None and cpu.calibration.prefill_flops == 6e9


def test_measuring_needs_a_hostfile_to_write_beside(tmp_path: Path) -> None:
    from mlxpipe.cluster.hostfile import parse_hostfile

    built_in = parse_hostfile([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2, tmp_path / "<built-in local-2>")
    with pytest.raises(UsageError) as info:
        measure(built_in)
    assert info.value.hint == "pass --hostfile with the hostfile of these hosts"
