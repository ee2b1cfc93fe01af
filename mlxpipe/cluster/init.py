"""``mlxpipe cluster init``: survey the hosts, wire Thunderbolt through MLX, write a hostfile ``doctor`` passes.

The sequence: survey every host over ssh (``survey.py``: chip, memory, macOS, disk, network,
Thunderbolt, RDMA, Pythons); where Thunderbolt cables join every host, run ``mlx.distributed_config``
(``thunderbolt.py``) for the wiring, the backend (ring over Thunderbolt, JACCL where RDMA is on) and
its hostfile; else pick the fastest network all hosts share (``addresses.py``). Then add mlxpipe's
keys (``memory_gb``, ``python``, ``hf_home``) and check the result with the hostfile parser.

What cannot be done over ssh comes back as ``Step`` lines, one per host and thing: Remote Login,
RDMA (Recovery mode, ``rdma_ctl enable``), a Thunderbolt Bridge to remove, the ``ifconfig`` commands
a host without passwordless sudo must run itself. The hostfile is written (atomically) only when it
is complete and every host holds the addresses it names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxpipe.cluster import addresses, thunderbolt
from mlxpipe.cluster.macos import BRIDGE, WIFI
from mlxpipe.cluster.survey import PACKAGES, Machine, survey
from mlxpipe.errors import SetupError
from mlxpipe.host import GB, Host

RDMA_STEP = ("enable RDMA for JACCL: restart it into Recovery (hold the power button), open Utilities > Terminal, "
             "run `rdma_ctl enable`, restart")
MACOS_STEP = "update macOS to 26.2 or later for RDMA over Thunderbolt 5 (JACCL)"
BRIDGE_STEP = ("remove the Thunderbolt Bridge (System Settings > Network > Thunderbolt Bridge > ... > Delete Service): "
               "it holds the Thunderbolt ports MLX configures, and comes back at each restart")


@dataclass(frozen=True)
class Step:
    """One thing to do by hand on one host (what ssh cannot do)."""

    host: str
    what: str
    blocking: bool = False  # the hostfile cannot be written until it is done

    def __str__(self) -> str:
        return f"on {self.host}: {self.what}"


@dataclass
class Outcome:
    """What ``init`` found and made: the machines, the hostfile's data (None: not written) and the steps."""

    machines: list[Machine]
    data: dict[str, Any] | None = None
    wiring: thunderbolt.Wiring | None = None
    network: addresses.Network | None = None
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what init chose and why, one line each
    to_install: list[str] = field(default_factory=list)  # hosts whose python lacks the controller's versions

    @property
    def complete(self) -> bool:
        return self.data is not None and not any(s.blocking for s in self.steps)


def survey_all(hosts: Sequence[str], on_done: Callable[[str, Machine | SetupError], None] | None = None
               ) -> tuple[list[Machine], list[Step]]:
    """Survey every host in parallel; a host ssh cannot reach becomes a blocking step."""
    def one(name: str) -> Machine | SetupError:
        try:
            result: Machine | SetupError = survey(Host(0, name))
        except SetupError as e:
            result = e
        if on_done:
            on_done(name, result)
        return result

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        results = list(pool.map(one, hosts))
    machines = [r for r in results if isinstance(r, Machine)]
    steps = [Step(name, f"{r.hint or r.message} ({r.message.split(': ', 1)[-1]})", blocking=True)
             for name, r in zip(hosts, results, strict=True) if isinstance(r, SetupError)]
    return machines, steps


def make(machines: list[Machine], *, versions: dict[str, str | None], python: str | None = None,
         wire: Callable[[Sequence[str], bool], thunderbolt.Wiring] = thunderbolt.wire,
         resurvey: Callable[[Sequence[str]], tuple[list[Machine], list[Step]]] = survey_all) -> Outcome:
    """The hostfile for ``machines`` (surveyed), wired through Thunderbolt where every host is cabled.

    ``versions``: the controller's mlxpipe, mlx and mlx-lm, which each host's interpreter should match.
    ``python``: the interpreter to name for every host, instead of the one found.
    """
    outcome = Outcome(machines)
    if len(machines) < 1:
        raise SetupError("no hosts to set up", "name the hosts (mlxpipe cluster init HOST ...) or pass --discover")
    outcome.steps += _bridge_steps(machines)
    cables = thunderbolt.cables(machines)
    order = machines
    if cables and not thunderbolt.uncabled(machines, cables):
        wiring = wire([m.ssh for m in machines], all(m.sudo for m in machines))
        outcome.wiring = wiring
        by_ssh = {m.ssh: m for m in machines}
        order = [by_ssh[h["ssh"]] for h in wiring.hosts]
        outcome.notes.append(f"Thunderbolt: {len(cables)} cable{'s' if len(cables) > 1 else ''} between "
                             f"{len(machines)} hosts; mlx.distributed_config chose the {wiring.backend} backend")
        outcome.steps += _rdma_steps(order, cables, wiring.backend)
        if wiring.backend == "ring":  # its addresses are the ring's: each host must hold its own
            order, missing = _check_wired(order, wiring, resurvey)
            outcome.steps += missing
    elif cables:
        loose = ", ".join(machines[i].ssh for i in thunderbolt.uncabled(machines, cables))
        outcome.notes.append(f"Thunderbolt: not used, {loose} not cabled to another host "
                             "(cable every host in a ring or a mesh to use it)")
    outcome.machines = order
    outcome.network = addresses.best_network([m.interfaces for m in order])
    outcome.data = _hostfile(order, outcome, versions, python)
    return outcome


def _hostfile(order: list[Machine], outcome: Outcome, versions: dict[str, str | None],
              python: str | None) -> dict[str, Any] | None:
    """The hostfile's data, or None (with a blocking step) when no network joins the hosts."""
    wiring, network = outcome.wiring, outcome.network
    if wiring is not None and wiring.backend == "ring":
        ips = [list(h["ips"]) for h in wiring.hosts]  # the ring over Thunderbolt: MLX's addresses
    elif network is not None:
        # JACCL's ips only name rank 0's coordinator: the fastest shared network beats MLX's en0 (Wi-Fi on a laptop).
        ips = [[ip] for ip in network.ips]
        outcome.notes.append(f"addresses: {network.kind} ({network.subnet})"
                             + ("; no wired network joins every host" if network.kind == WIFI else ""))
    elif wiring is not None and all(h["ips"] for h in wiring.hosts):
        ips = [list(h["ips"]) for h in wiring.hosts]
    else:
        names = ", ".join(m.ssh for m in order)
        outcome.steps.append(Step(names, "connect these hosts to one network (Ethernet, or Thunderbolt cables): "
                                         "no subnet holds an address of each", blocking=True))
        return None
    entries = []
    for rank, m in enumerate(order):
        entry: dict[str, Any] = {"ssh": m.ssh, "ips": ips[rank]}
        if wiring and wiring.hosts[rank]["rdma"]:
            entry["rdma"] = wiring.hosts[rank]["rdma"]
        if m.memory_bytes:
            entry["memory_gb"] = round(m.memory_bytes / GB)
        entry["python"] = python or _python_for(m, versions, outcome)
        entry["hf_home"] = m.hf_home or f"{m.home.rstrip('/')}/.cache/huggingface"
        entries.append(entry)
    return {"backend": wiring.backend if wiring else "ring", "envs": list(wiring.envs) if wiring else [],
            "hosts": entries}


def _python_for(m: Machine, versions: dict[str, str | None], outcome: Outcome) -> str:
    """mlxpipe's venv when it has the controller's versions, else another interpreter that has them,
    else the venv (``cluster install`` makes it; the host is listed to install)."""
    wanted = {name: versions.get(name) for name in PACKAGES}
    candidates = sorted(m.pythons, key=lambda p: p.path != m.venv_python)
    for p in candidates:
        if all(p.packages.get(name) == version for name, version in wanted.items()):
            return p.path
    outcome.to_install.append(m.ssh)
    return m.venv_python


def _bridge_steps(machines: Sequence[Machine]) -> list[Step]:
    steps = []
    for m in machines:
        tb = set(m.thunderbolt_devices.values())
        if any(i.kind == BRIDGE and set(i.members) & tb for i in m.interfaces):
            steps.append(Step(m.ssh, BRIDGE_STEP))
    return steps


def _rdma_steps(order: Sequence[Machine], cables: Sequence[thunderbolt.Cable], backend: str) -> list[Step]:
    """Where Thunderbolt 5 joins the hosts but the backend is not JACCL: what each host lacks for RDMA."""
    if backend.startswith("jaccl") or not any(c.generation == 5 for c in cables):
        return []
    steps = []
    for m in order:
        if m.rdma is None:
            steps.append(Step(m.ssh, MACOS_STEP))
        elif not m.rdma:
            steps.append(Step(m.ssh, RDMA_STEP))
    return steps


def _check_wired(
    order: list[Machine],
    wiring: thunderbolt.Wiring,
    resurvey: Callable[[Sequence[str]], tuple[list[Machine], list[Step]]],
) -> tuple[list[Machine], list[Step]]:
    """After a set-up MLX could only print: does each host hold its Thunderbolt addresses? If not, its commands."""
    machines, failed = resurvey([m.ssh for m in order])
    if failed:
        return order, failed
    steps = []
    for m, wired in zip(machines, wiring.hosts, strict=True):
        held = {str(a.ip) for i in m.interfaces for a in i.addresses}
        if set(wired["ips"]) <= held:
            continue
        if wiring.setup.get(m.ssh):
            what = (f"configure its Thunderbolt ports, then run init again (or allow passwordless sudo there and "
                    f"init does it): {wiring.setup[m.ssh]}")
        else:
            what = (f"its Thunderbolt addresses {', '.join(wired['ips'])} are not set although mlx.distributed_config "
                    "configured it: check its Thunderbolt cables and run init again")
        steps.append(Step(m.ssh, what, blocking=True))
    return machines, steps


def check_and_write(outcome: Outcome, path: Path) -> None:
    """Validate the hostfile with mlxpipe's own parser, then replace ``path`` with it in one step."""
    from mlxpipe.cluster.hostfile import parse_hostfile
    from mlxpipe.paths import replacing

    assert outcome.data is not None
    parse_hostfile(outcome.data, path)
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(outcome.data, indent=2) + "\n")
