"""worker/measure/link_probe.py on one rank in this process: a machine measured, the messages answered in turn, the
CPU's share of cores while measuring. Pairs of ranks measure their link in tests/e2e/test_layout.py."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Bye, CollectiveMeasured, HostMeasured, Joined
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import Exit, MeasureCollective, MeasureHost
from mlxpipe.worker.measure import link_probe


def test_one_rank_answers_each_measurement_then_says_bye(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    stream = io.StringIO(b"".join(wire.encode(m) for m in (MeasureHost(rank=0), MeasureHost(rank=3),
                                                            MeasureCollective(rounds=3), Exit())).decode())
    said: list[Event] = []
    link_probe.run(1, stream, said.append)
    assert [type(e) for e in said] == [Joined, HostMeasured, CollectiveMeasured, Bye]  # rank 3's is not ours
    host = said[1]
    assert isinstance(host, HostMeasured)
    assert host.device == "cpu" and host.dtype == "float32" and host.calibration is None
    assert host.memory_bandwidth > 1e8 and host.compute > 1e7
    assert host.chip == link_probe.chip_name()[0] and host.performance_cores is None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_shared_cpu_is_measured_on_its_share_of_the_cores() -> None:
    allowed = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    with link_probe.cores_share(len(allowed)):
        seen.append(os.sched_getaffinity(0))
        worker = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        worker.start()
        worker.join()
    assert seen == [{min(allowed)}, {min(allowed)}]  # threads started meanwhile too
    assert os.sched_getaffinity(0) == allowed
    with link_probe.cores_share(1):
        assert os.sched_getaffinity(0) == allowed
