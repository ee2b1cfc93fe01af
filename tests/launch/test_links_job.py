"""launch/links_job.py without ranks: the ring's pairs, a machine's published bandwidth, the hostfile the facts are
written beside. The links job itself runs on real ranks in tests/e2e/test_layout.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.errors import UsageError
from mlxpipe.launch.links_job import host_facts_of, measure, ring_pairs
from mlxpipe.protocol.events import HostMeasured


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
