"""Links measured, not guessed: a real MLX job over the hostfile's backend (``mlxpipe doctor --links``).

``measure`` starts one rank per host through ``mlx.launch`` (``launch/ranks.py``, as a pipeline
starts; the ranks run ``python -m mlxpipe.worker --links N``), then asks for one measurement at a time:

* each machine (once, by its first rank): its chip, its memory bandwidth (Apple's published figure
  for a chip ``cluster/chips.py`` lists, else the measured one) and a large matrix product's rate;
  with ``calibrate``, what real transformer layers reach there;
* each pair of ranks that exchange data: on the ring, MLX only sends between neighbours, so rank i
  and i + 1, and the last and the first; the latency of a small message (half the median round trip)
  and the bandwidth of a large one;
* the small all-reduce every rank joins at every engine tick.

The facts go beside the hostfile (``cluster/facts_file.py``), where ``plan`` and the launching
commands read them. The job lives at the launch level because it starts ranks; ``cluster/`` only
reads and writes what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from mlxpipe.cluster import chips
from mlxpipe.cluster.facts_file import write_facts
from mlxpipe.cluster.hostfile import Hostfile, load_hostfile
from mlxpipe.defaults import DEFAULT_BACKEND
from mlxpipe.errors import LaunchError, UsageError
from mlxpipe.launch.command import LaunchSpec, default_port
from mlxpipe.launch.ranks import Ranks
from mlxpipe.plan.cluster_facts import Calibration, ClusterFacts, HostFacts, LinkFacts
from mlxpipe.protocol.events import LINKS_EVENTS, CollectiveMeasured, HostMeasured, Joined, LinkMeasured
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import MeasureCollective, MeasureHost, MeasureLink

DEFAULT_ROUNDS = 200  # round trips per link (fewer when they take longer than worker.measure.link_probe.LINK_SECONDS)
DEFAULT_LARGE = 16 * 1024 * 1024  # bytes of the large message
COLLECTIVE_ROUNDS = 100
START_TIMEOUT = 120.0  # seconds for every rank to join the group
STEP_TIMEOUT = 600.0  # seconds one measurement may take (a calibration on a slow CPU)
WORKER = ("-m", "mlxpipe.worker", "--links")

E = TypeVar("E", bound=Event)
Progress = Callable[[str], None]


def measure(hostfile: Path | Hostfile, *, calibrate: bool = False, backend: str | None = None, port: int | None = None,
            rounds: int = DEFAULT_ROUNDS, large: int = DEFAULT_LARGE, on_progress: Progress | None = None,
            save: bool = True) -> ClusterFacts:
    """Measure every host and link of ``hostfile`` by a real MLX job; save the facts beside it (``save``)."""
    hosts = hostfile if isinstance(hostfile, Hostfile) else load_hostfile(hostfile)
    if save and not hosts.path.is_file():
        raise UsageError(f"the links' facts are written beside the hostfile, and {hosts.path} is no file",
                         "pass --hostfile with the hostfile of these hosts")
    chosen = backend or hosts.backend or DEFAULT_BACKEND
    say = on_progress or (lambda text: None)
    spec = LaunchSpec(hostfile=hosts, worker_args=(*WORKER, str(hosts.size)), backend=chosen,
                      env=(("TOKENIZERS_PARALLELISM", "false"),), port=port or default_port(hosts))
    ranks = Ranks(spec)
    ranks.start()
    try:
        events = _typed(ranks)
        for joined, _ in enumerate(_until(events, Joined, START_TIMEOUT, ranks), start=1):
            if joined == hosts.size:
                break
        facts = _measure(ranks, events, hosts, chosen, calibrate, rounds, large, say)
    except BaseException:
        ranks.stop()
        raise
    ranks.close()
    if save:
        write_facts(facts, hosts.path)
    return facts


def _measure(ranks: Ranks, events: Iterator[Event], hosts: Hostfile, backend: str, calibrate: bool, rounds: int,
             large: int, say: Progress) -> ClusterFacts:
    machines: dict[str, HostFacts] = {}
    host_facts = []
    for h in hosts.hosts:
        if h.ssh not in machines:  # ranks on one machine share it: measured once, by the first
            say(f"measuring {h.ssh} (rank {h.rank}){': calibrating real layers' if calibrate else ''}...")
            share = sum(other.ssh == h.ssh for other in hosts.hosts)
            ranks.send(MeasureHost(rank=h.rank, calibrate=calibrate, share=share))
            measured = _next(events, HostMeasured, STEP_TIMEOUT, ranks)
            machines[h.ssh] = host_facts_of(measured, h.ssh)
        host_facts.append(replace(machines[h.ssh], rank=h.rank))
    links = []
    for a, b in ring_pairs(hosts.size):
        say(f"measuring the link between rank {a} ({hosts.hosts[a].ssh}) and rank {b} ({hosts.hosts[b].ssh})...")
        ranks.send(MeasureLink(a=a, b=b, rounds=rounds, large=large))
        link = _next(events, LinkMeasured, STEP_TIMEOUT, ranks)
        links.append(LinkFacts(ranks=(a, b), latency=link.latency, bandwidth=link.bandwidth, rounds=link.rounds))
    collective = None
    if hosts.size > 1:
        say(f"measuring the all-reduce of {hosts.size} ranks...")
        ranks.send(MeasureCollective(rounds=COLLECTIVE_ROUNDS))
        collective = _next(events, CollectiveMeasured, STEP_TIMEOUT, ranks).seconds
    return ClusterFacts(hosts=tuple(host_facts), links=tuple(links), backend=backend, collective=collective,
                        addresses=tuple((h.ssh, tuple(h.ips)) for h in hosts.hosts),
                        measured=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def host_facts_of(event: HostMeasured, ssh: str) -> HostFacts:
    """A machine's facts: Apple's published bandwidth for a listed chip, else the measured one."""
    row = chips.lookup(event.chip, event.performance_cores)
    calibration = Calibration(**event.calibration) if event.calibration is not None else None
    return HostFacts(rank=event.rank, ssh=ssh, chip=event.chip, device=event.device,
                     memory_bandwidth=row.bandwidth if row else event.memory_bandwidth,
                     memory_bandwidth_source=row.source if row else "measured", compute=event.compute,
                     calibration=calibration)


def ring_pairs(size: int) -> list[tuple[int, int]]:
    """The pairs of ranks MLX's ring exchanges data between: neighbours, and the last with the first."""
    pairs = [(r, r + 1) for r in range(size - 1)]
    if size > 2:
        pairs.append((0, size - 1))
    return pairs


def _typed(ranks: Ranks) -> Iterator[Event]:
    for data in ranks.events(STEP_TIMEOUT):
        yield LINKS_EVENTS.from_wire(data)


def _next(events: Iterator[Event], kind: type[E], timeout: float, ranks: Ranks) -> E:
    for event in _until(events, kind, timeout, ranks):
        return event
    raise LaunchError("the links job's ranks ended before answering", f"logs: {ranks.run_dir}")


def _until(events: Iterator[Event], kind: type[E], timeout: float, ranks: Ranks) -> Iterator[E]:
    """The events of ``kind`` as they come; ``LaunchError`` after ``timeout`` seconds without one."""
    deadline = time.monotonic() + timeout
    for event in events:
        if isinstance(event, kind):
            yield event
            deadline = time.monotonic() + timeout
        elif time.monotonic() > deadline:
            raise LaunchError(f"no {kind.TAG} event from the links job's ranks in {timeout:.0f} s",
                              f"logs: {ranks.run_dir}")
