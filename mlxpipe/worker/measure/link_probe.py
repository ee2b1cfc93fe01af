"""A links job's rank: ``python -m mlxpipe.worker --links N`` (``mlxpipe doctor --links``, ``cluster init``).

Its own entry rather than a message to the rank loop: it loads no model (the loop's ranks exist to
hold one), so it starts in a second and needs nothing but MLX on each host. Every rank joins the
job's group (the hostfile's backend, as a pipeline would) and takes the controller's messages in
turn (``protocol.messages``: ``measure_host``, ``measure_link``, ``measure_collective``): one
measurement at a time, the ranks not in it waiting on their standard input, idle (a rank waiting
inside a collective would spin on its core, taking it from the measured ranks where they share
a machine). Small messages go on the ranks' default stream, as the pipeline's hidden states do;
the collective on the CPU stream, as the engine's per-tick one does (``worker.agree``).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import mlx.core as mx

from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Bye, CollectiveMeasured, HostMeasured, Joined, LinkMeasured
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import MESSAGES, Exit, MeasureCollective, MeasureHost, MeasureLink
from mlxpipe.worker.groups import init_group
from mlxpipe.worker.load import barrier

Emit = Callable[[Event], None]

WARM_ROUNDS = 5
LINK_SECONDS = 3.0  # a link's round trips stop after this long, whatever their count
BANDWIDTH_REPEATS = 3
_GO, _STOP = 1, 0  # what the first rank of a pair sends: another round trip, or the end of them


def run(world_size: int, stream: IO[str] | None = None, emit: Emit = wire.emit) -> None:
    """Join the group, then answer the controller's measurements until ``exit``."""
    group = init_group(world_size)
    rank, host = group.rank(), socket.gethostname()
    emit(Joined(rank=rank, host=host))
    source = stream or sys.stdin
    while True:
        data = wire.read_request(source)
        message = None if data is None else MESSAGES.from_wire(data)
        if message is None or isinstance(message, Exit):
            barrier(group)
            emit(Bye(rank=rank, host=host))
            return
        if isinstance(message, MeasureHost):
            if message.rank == rank:
                with cores_share(message.share):
                    emit(measure_host(rank, host, message.calibrate))
        elif isinstance(message, MeasureLink):
            if rank in (message.a, message.b):
                measured = measure_link(group, message)
                if measured is not None:
                    emit(measured)
        elif isinstance(message, MeasureCollective):
            seconds = measure_collective(group, message.rounds)
            if rank == 0:
                emit(CollectiveMeasured(rank=0, seconds=seconds, rounds=message.rounds))
        else:
            raise ValueError(f"a {message.TAG!r} message to a links job")


# --- a link ---------------------------------------------------------------------------------


def measure_link(group: Any, message: MeasureLink) -> LinkMeasured | None:
    """Round trips of a small message, then ``large`` bytes one way; what rank ``a`` measured (None on ``b``)."""
    first = group.rank() == message.a
    peer = message.b if first else message.a
    trips = _round_trips(group, peer, first, message.rounds)
    rtt = statistics.median(trips) if first else 0.0
    transfers = [_one_way(group, peer, first, message.large) for _ in range(BANDWIDTH_REPEATS)]
    if not first:
        return None
    best = max(min(transfers) - rtt, 1e-9)  # the large message's way, the small reply's taken off
    ranked = sorted(trips)
    return LinkMeasured(rank=message.a, peer=message.b, latency=rtt / 2, bandwidth=message.large / best,
                        rounds=len(trips), large=message.large,
                        round_trips=[_percentile(ranked, q) for q in (0.1, 0.5, 0.9)])


def _round_trips(group: Any, peer: int, first: bool, rounds: int) -> list[float]:
    """The first rank's round-trip times: it sends ``_GO`` and waits for the echo, ``rounds`` times (fewer after
    ``LINK_SECONDS``), then ``_STOP``; the other echoes every ``_GO``."""
    go, stop = mx.array([_GO], mx.int32), mx.array([_STOP], mx.int32)
    trips: list[float] = []
    if first:
        deadline = time.perf_counter() + LINK_SECONDS
        for i in range(WARM_ROUNDS + rounds):
            tic = time.perf_counter()
            mx.eval(mx.distributed.send(go, peer, group=group))
            mx.eval(mx.distributed.recv_like(go, peer, group=group))
            if i >= WARM_ROUNDS:
                trips.append(time.perf_counter() - tic)
                if time.perf_counter() > deadline:
                    break
        mx.eval(mx.distributed.send(stop, peer, group=group))
        return trips
    while True:
        got = mx.distributed.recv_like(go, peer, group=group)
        if got.item() == _STOP:
            return trips
        mx.eval(mx.distributed.send(got, peer, group=group))


def _one_way(group: Any, peer: int, first: bool, nbytes: int) -> float:
    """``nbytes`` from the first rank to the other, which answers with a small message: the first rank's time."""
    large = mx.zeros((nbytes,), mx.uint8)
    ack = mx.array([_GO], mx.int32)
    mx.eval(large, ack)
    if first:
        tic = time.perf_counter()
        mx.eval(mx.distributed.send(large, peer, group=group))
        mx.eval(mx.distributed.recv_like(ack, peer, group=group))
        return time.perf_counter() - tic
    mx.eval(mx.distributed.recv_like(large, peer, group=group))
    mx.eval(mx.distributed.send(ack, peer, group=group))
    return 0.0


def measure_collective(group: Any, rounds: int) -> float:
    """The median time of a small all-reduce over every rank, read back to Python as the engine reads its tick."""
    mine = mx.array([group.rank()], mx.int32)
    times = []
    for i in range(WARM_ROUNDS + rounds):
        tic = time.perf_counter()
        mx.distributed.all_sum(mine, group=group, stream=mx.cpu).tolist()
        if i >= WARM_ROUNDS:
            times.append(time.perf_counter() - tic)
    return statistics.median(times)


def _percentile(ranked: list[float], q: float) -> float:
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


# --- a machine ------------------------------------------------------------------------------


def measure_host(rank: int, host: str, calibrate: bool) -> HostMeasured:
    """This machine's chip, its memory bandwidth and matrix throughput; with ``calibrate``, real layers too."""
    gpu = mx.default_device() == mx.gpu
    dtype = mx.float16 if gpu else mx.float32
    chip, cores = chip_name()
    calibration = None
    if calibrate:
        from mlxpipe.worker.measure.calibrate import calibrate_layers

        calibration = calibrate_layers(dtype, gpu)
    return HostMeasured(rank=rank, host=host, chip=chip, performance_cores=cores, device="gpu" if gpu else "cpu",
                        memory_bandwidth=memory_bandwidth(gpu), compute=matmul_rate(dtype, gpu),
                        dtype=str(dtype).removeprefix("mlx.core."), calibration=calibration)


@contextmanager
def cores_share(share: int) -> Iterator[None]:
    """On a CPU that ``share`` ranks share: every thread of this process on its share of the cores (the first of
    them) while measuring, as each rank of a run gets about that many; no change on a GPU or where Linux's
    affinity calls are missing."""
    task_dir = Path("/proc/self/task")
    if share <= 1 or mx.default_device() == mx.gpu or not hasattr(os, "sched_setaffinity") or not task_dir.is_dir():
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    mine = set(allowed[: max(1, len(allowed) // share)])
    threads = [int(t.name) for t in task_dir.iterdir()]
    _set_affinity(threads, mine)
    try:
        yield
    finally:
        _set_affinity([int(t.name) for t in task_dir.iterdir()], set(allowed))


def _set_affinity(threads: list[int], cores: set[int]) -> None:
    for tid in threads:
        with suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)


def chip_name() -> tuple[str, int | None]:
    """The CPU's brand string ("Apple M2 Ultra"), and a Mac's performance cores (None elsewhere)."""
    if platform.system() == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.processor(), _int(_sysctl("hw.perflevel0.physicalcpu"))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip(), None
    except OSError:
        pass
    return platform.processor() or platform.machine(), None


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def memory_bandwidth(gpu: bool) -> float:
    """Bytes/s of one pass over a large array (a sum: every byte read once), the best of 5."""
    nbytes = (512 if gpu else 256) * 1024 * 1024
    a = mx.ones((nbytes // 4,), mx.float32)
    mx.eval(a)
    best = min(_timed(lambda: mx.eval(a.sum())) for _ in range(6))  # the first is a warm-up, and min skips it
    return nbytes / best


def matmul_rate(dtype: Any, gpu: bool) -> float:
    """FLOP/s of a square matrix product in ``dtype`` on the default device, the best of a few."""
    n = 4096 if gpu else 1024
    a, b = mx.random.normal((n, n)).astype(dtype), mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    best, spent = float("inf"), 0.0
    while spent < 0.5 or best == float("inf"):
        t = _timed(lambda: mx.eval(a @ b))
        best, spent = min(best, t), spent + t
    return 2 * n**3 / best


def _timed(work: Callable[[], Any]) -> float:
    tic = time.perf_counter()
    work()
    return time.perf_counter() - tic


def main(world_size: int) -> None:
    """The entry ``python -m mlxpipe.worker --links N`` calls."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(world_size)
