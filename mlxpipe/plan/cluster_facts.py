"""The cluster's facts: what each host computes at and what each link carries, measured once.

``mlxpipe doctor --links`` (and ``mlxpipe cluster init``) runs a real MLX job over the hostfile
and writes these beside it (``cluster.json`` -> ``cluster.facts.json``, ``launch/links_job.py``);
the cost model (``plan/estimate.py``) reads them. Pure: plain data and its JSON, no MLX, no
file I/O (``cluster/facts_file.py`` reads and writes the file).

Units are SI throughout: seconds, bytes per second, FLOP per second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mlxpipe.errors import HostfileError

FACTS_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What a host reached running real transformer layers (``doctor --links --calibrate``): the figures the
    cost model uses instead of the published ones, which no model reaches."""

    decode_bandwidth: float  # bytes/s of weights a one-token decode step reads, layer overhead aside
    prefill_flops: float  # FLOP/s of a prompt chunk's matrix products, attention included
    layer_overhead: float  # seconds one layer costs per forward pass whatever its size (dispatch, small ops)
    step_overhead: float = 0.0  # seconds one engine tick costs a rank beyond its layers (sampling, bookkeeping)


@dataclass(frozen=True)
class HostFacts:
    """One rank's machine, as measured or looked up."""

    rank: int
    ssh: str
    chip: str  # "Apple M2 Ultra", or the CPU's model name
    device: str  # where MLX computes there: "gpu" or "cpu"
    memory_bandwidth: float  # bytes/s: the chip's published figure, else measured
    memory_bandwidth_source: str  # the spec page it comes from, or "measured"
    compute: float  # FLOP/s of a large matrix product in the model's precision, measured
    calibration: Calibration | None = None


@dataclass(frozen=True)
class LinkFacts:
    """Two ranks that exchange data (on the ring: direct neighbours), measured both ways."""

    ranks: tuple[int, int]
    latency: float  # seconds: half the median round trip of a small message
    bandwidth: float  # bytes/s of a large message, one way
    rounds: int = 0  # round trips the median is of


@dataclass(frozen=True)
class ClusterFacts:
    """Every host and link of one hostfile, and the world's small all-reduce (the engine's per-tick collective)."""

    hosts: tuple[HostFacts, ...]
    links: tuple[LinkFacts, ...]
    backend: str
    collective: float | None = None  # seconds of a small all_sum over every rank, median
    addresses: tuple[tuple[str, tuple[str, ...]], ...] = ()  # each rank's (ssh, ips): whose facts these are
    measured: str = ""  # when, ISO 8601
    version: int = FACTS_VERSION
    notes: tuple[str, ...] = field(default=())

    @property
    def size(self) -> int:
        return len(self.hosts)

    def host(self, rank: int) -> HostFacts:
        return self.hosts[rank]

    def link(self, a: int, b: int) -> LinkFacts | None:
        """The measured link between ranks ``a`` and ``b`` (either order), None when they exchange nothing."""
        pair = (min(a, b), max(a, b))
        return next((link for link in self.links if tuple(sorted(link.ranks)) == pair), None)

    def calibrated(self) -> bool:
        return all(h.calibration is not None for h in self.hosts)

    def matches(self, addresses: Sequence[tuple[str, Sequence[str]]]) -> bool:
        """Whether these facts are of hosts with these (ssh, ips), in this order."""
        return self.addresses == tuple((ssh, tuple(ips)) for ssh, ips in addresses)

    def with_calibration(self, calibration: Calibration) -> ClusterFacts:
        """Every host calibrated alike (the tests' ranks share one machine)."""
        return replace(self, hosts=tuple(replace(h, calibration=calibration) for h in self.hosts))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["links"] = [{**asdict(link), "ranks": list(link.ranks)} for link in self.links]
        data["addresses"] = [{"ssh": ssh, "ips": list(ips)} for ssh, ips in self.addresses]
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> ClusterFacts:
        """``to_json``'s output back; ``HostfileError`` naming ``where`` and the field for anything else."""
        if not isinstance(data, Mapping):
            raise HostfileError(f"{where}: expected a JSON object", _REMEASURE)
        if data.get("version") != FACTS_VERSION:
            raise HostfileError(f"{where}: facts of version {data.get('version')!r}, this mlxpipe reads "
                                f"{FACTS_VERSION}", _REMEASURE)
        try:
            hosts = tuple(_host(h) for h in data["hosts"])
            links = tuple(LinkFacts(ranks=(int(link["ranks"][0]), int(link["ranks"][1])),
                                    latency=_number(link, "latency"), bandwidth=_number(link, "bandwidth"),
                                    rounds=int(link.get("rounds", 0))) for link in data["links"])
            addresses = tuple((str(a["ssh"]), tuple(str(ip) for ip in a["ips"])) for a in data.get("addresses", ()))
            collective = data.get("collective")
            return cls(hosts=hosts, links=links, backend=str(data["backend"]),
                       collective=None if collective is None else float(collective), addresses=addresses,
                       measured=str(data.get("measured", "")), notes=tuple(str(n) for n in data.get("notes", ())))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise HostfileError(f"{where}: not a cluster facts file ({type(e).__name__}: {e})", _REMEASURE) from None


_REMEASURE = "measure them again: mlxpipe doctor --links --hostfile HOSTFILE"


def _number(data: Mapping[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key!r} must be a positive number, got {value!r}")
    return float(value)


def _host(data: Mapping[str, Any]) -> HostFacts:
    raw = data.get("calibration")
    calibration = None
    if raw is not None:
        calibration = Calibration(decode_bandwidth=_number(raw, "decode_bandwidth"),
                                  prefill_flops=_number(raw, "prefill_flops"),
                                  layer_overhead=float(raw["layer_overhead"]),
                                  step_overhead=float(raw.get("step_overhead", 0.0)))
    return HostFacts(rank=int(data["rank"]), ssh=str(data["ssh"]), chip=str(data["chip"]), device=str(data["device"]),
                     memory_bandwidth=_number(data, "memory_bandwidth"),
                     memory_bandwidth_source=str(data["memory_bandwidth_source"]),
                     compute=_number(data, "compute"), calibration=calibration)
