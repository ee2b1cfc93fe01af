"""``mlxpipe doctor``: check every host before a run, with a fix for each failure.

One small probe per host (one ssh connection, one Python process, whatever the
number of ranks there) reports the interpreter, the installed mlx, mlx-lm and
mlxpipe, memory, free disk, files already present and whether the ring ports
bind. The checks compare those facts across hosts and against the plan:

* ``ssh``: reachable without a password (BatchMode, short connect timeout);
  127.0.0.1 needs no ssh.
* ``python``: the host's interpreter runs and is recent enough.
* ``versions``: mlx, mlx-lm and mlxpipe installed, and the same everywhere (a
  mismatch is a known cause of "Missing N parameters" at load time).
* ``ports``: the ring ports ``mlx.launch`` will give this host's ranks bind on
  its addresses.
* ``memory`` / ``disk`` (with a plan): the host holds its ranks' share, and has
  room for the files it still has to download.

The layout's own checks (``tp links``, ``layout``) are ``cluster/layout_checks.py``'s.
``preflight`` is what ``generate`` runs before it starts any rank.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxpipe.cluster import remote, storage
from mlxpipe.cluster.check_result import FAIL, OK, SKIP, WARN, CheckResult
from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.cluster.layout_checks import tp_link_checks
from mlxpipe.cluster.probe import MARK
from mlxpipe.console import human_bytes
from mlxpipe.defaults import DEFAULT_PORT
from mlxpipe.errors import LaunchError
from mlxpipe.host import GB, Host
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan, make_plan

CONNECT_TIMEOUT = 5
PROBE_TIMEOUT = 30.0
MIN_PYTHON = (3, 10)
PACKAGES = ("mlx", "mlx-lm", "mlxpipe")
CHECKS = ("ssh", "python", "versions", "ports", "memory", "disk", "tp links", "layout")

# Runs on each host as ``python -c PROBE ARGS`` (see cluster/probe.py: stdlib only).
PROBE = (Path(__file__).parent / "probe.py").read_text()


@dataclass
class _Probe:
    """One probe run: the hosts it covers, what it asks, and what came back."""

    hosts: tuple[Host, ...]  # the ranks sharing this ssh destination and interpreter
    python: str
    ports: list[tuple[str, int]] = field(default_factory=list)
    files: dict[str, dict[str, int]] = field(default_factory=dict)  # model dir -> file -> bytes
    file_ranks: dict[str, list[int]] = field(default_factory=dict)  # model dir -> the ranks reading it
    facts: dict[str, Any] | None = None
    returncode: int | None = None
    stderr: str = ""

    @property
    def host(self) -> Host:
        return self.hosts[0]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(h.rank for h in self.hosts)

    def result(self, check: str, status: str, detail: str, fix: str | None = None) -> CheckResult:
        return CheckResult(self.host.ssh, self.ranks, check, status, detail, fix)


# --- Entry points ----------------------------------------------------------------------


def preflight(
    hostfile: Hostfile,
    plan: Plan | None = None,
    meta: ModelMetadata | None = None,
    *,
    port: int | None = None,
    backend: str | None = None,
    tp: int = 1,
) -> list[CheckResult]:
    """ssh, python, versions and ports on every host, in parallel; memory and disk too given a plan.

    Every check comes from one probe per (host, interpreter), so this costs one
    ssh round trip and one Python start per machine, whatever the checks: with
    a plan, ``generate`` gets the memory and disk checks for free. ``tp`` (the plan's when there is
    one): the groups' links are checked too.
    """
    backend = backend or hostfile.backend or "ring"
    all_local = all(h.is_local for h in hostfile.hosts)
    probes = _probes(hostfile, plan, meta, port, backend)
    with ThreadPoolExecutor(max_workers=len(probes)) as pool:
        list(pool.map(_run_probe, probes))
    references = _reference_versions([p for p in probes if p.facts is not None])
    results: list[CheckResult] = []
    for p in probes:
        results += _host_checks(p, references, all_local=all_local, port=port, backend=backend)
    if plan is not None and meta is not None:
        results += _memory_checks(probes, hostfile, plan, meta)
        results += _disk_checks(probes)
    results += tp_link_checks(hostfile, plan.tp if plan is not None else tp, backend)
    return sorted(results, key=lambda r: (r.ranks[0], CHECKS.index(r.check)))


def require_ok(results: Sequence[CheckResult]) -> None:
    """Raise ``LaunchError`` naming the first failed check (for ``generate`` before it launches)."""
    failed = [r for r in results if r.failed]
    if not failed:
        return
    first = failed[0]
    more = f" ({len(failed) - 1} more checks failed; see `mlxpipe doctor`)" if len(failed) > 1 else ""
    raise LaunchError(f"preflight: {first.host}: {first.check}: {first.detail}{more}", first.fix)


def ring_ports(hostfile: Hostfile, base: int) -> list[tuple[int, str, int]]:
    """``(rank, ip, port)`` as ``mlx.launch --backend ring`` assigns them: one per rank and ip, in order."""
    ports, port = [], base
    for h in hostfile.hosts:
        for ip in h.ips:
            ports.append((h.rank, ip, port))
            port += 1
    return ports


# --- Probing -----------------------------------------------------------------------------


def _probes(
    hostfile: Hostfile, plan: Plan | None, meta: ModelMetadata | None, port: int | None, backend: str
) -> list[_Probe]:
    """One probe per (ssh destination, interpreter), with its ranks' ports and files."""
    groups: dict[tuple[str, str], list[Host]] = {}
    for h in hostfile.hosts:
        groups.setdefault((h.ssh, remote.python_for(h)), []).append(h)
    probes = [_Probe(tuple(hosts), python) for (_, python), hosts in groups.items()]
    by_rank = {h.rank: p for p in probes for h in p.hosts}
    if backend == "ring" and (port is not None or not all(h.is_local for h in hostfile.hosts)):
        for rank, ip, number in ring_ports(hostfile, port or DEFAULT_PORT):
            by_rank[rank].ports.append((ip, number))
    if plan is not None and meta is not None:
        for p in probes:
            for h in p.hosts:
                directory = storage.model_path(h, meta)
                p.file_ranks.setdefault(directory, []).append(h.rank)
                files = p.files.setdefault(directory, {})
                for name in (*plan.support_files, *plan.ranks[h.rank].files):
                    files[name] = meta.file_sizes.get(name, 0)
    return probes


def _run_probe(probe: _Probe) -> None:
    args = json.dumps({"packages": PACKAGES, "ports": probe.ports, "paths": sorted(probe.files),
                       "files": probe.files})
    argv = remote.host_argv(probe.host, [probe.python, "-c", PROBE, args])
    if not probe.host.is_local:
        # ssh keeps the first value given for an option: this one wins over remote.SSH_OPTIONS.
        argv[1:1] = ["-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        probe.returncode, probe.stderr = -1, f"no answer within {PROBE_TIMEOUT:.0f} s"
        return
    except OSError as e:  # the interpreter of a local host does not exist
        probe.returncode, probe.stderr = 127, e.strerror or str(e)
        return
    probe.returncode, probe.stderr = proc.returncode, proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            try:
                probe.facts = json.loads(line[len(MARK):])
            except json.JSONDecodeError:
                pass


# --- Checks ------------------------------------------------------------------------------


def _host_checks(
    p: _Probe, references: dict[str, tuple[str, list[str]]], *, all_local: bool, port: int | None, backend: str
) -> list[CheckResult]:
    ssh = _ssh_check(p)
    if ssh.failed:
        return [ssh]
    python = _python_check(p)
    if python.failed:
        return [ssh, python]
    return [ssh, python, _versions_check(p, references), _ports_check(p, all_local, port, backend)]


def _ssh_check(p: _Probe) -> CheckResult:
    if p.host.is_local:
        return p.result("ssh", OK, "this machine (no ssh)")
    if p.returncode == 255 or (p.returncode == -1 and p.facts is None):
        reason = _last_line(p.stderr) or "ssh failed"
        return p.result("ssh", FAIL, f"cannot connect: {reason}", ssh_fix(p.host.ssh, reason))
    return p.result("ssh", OK, "key login works (BatchMode)")


def ssh_fix(host: str, reason: str) -> str:
    """What to do about an ssh failure, from ssh's last line (``mlxpipe cluster`` says the same)."""
    text = reason.lower()
    if "permission denied" in text:
        return f"install your key there: ssh-copy-id {host}"
    if "host key" in text:
        return f"check and accept its host key once: ssh {host} true"
    if "refused" in text:
        return f"turn on Remote Login on {host} (System Settings > General > Sharing), or start its sshd"
    if "resolve" in text:
        return f"check the name {host!r}, or use the host's IP address in the hostfile"
    return f"check that {host} is on and reachable from here, then that `ssh {host} true` works without a password"


def _python_check(p: _Probe) -> CheckResult:
    where = f"{p.python} on {p.host.ssh}"
    setting = f"set 'python' for {p.host.ssh} in the hostfile to an interpreter with mlxpipe installed"
    if p.facts is None:
        reason = _last_line(p.stderr) or f"exited with status {p.returncode}"
        if p.returncode == 127 or "not found" in reason or "No such file" in reason:
            return p.result("python", FAIL, f"{where}: not found", setting)
        return p.result("python", FAIL, f"{where} did not run the probe: {reason}", setting)
    version = p.facts["python"]
    system = f"{p.facts.get('system')} {p.facts.get('machine')}"
    if tuple(int(x) for x in version.split(".")[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return p.result("python", FAIL, f"{where} is Python {version}; mlxpipe needs {need} or newer", setting)
    return p.result("python", OK, f"{p.facts.get('executable') or p.python}: Python {version} ({system})")


def _reference_versions(probes: Sequence[_Probe]) -> dict[str, tuple[str, list[str]]]:
    """Per package, the version most hosts have (ties: the lowest rank's) and those hosts."""
    references = {}
    for name in ("python", *PACKAGES):
        values = [_version(p, name) for p in probes]
        counts = Counter(v for v in values if v)
        if counts:
            top = max(counts.values())
            value = next(v for v in values if v and counts[v] == top)
            references[name] = (value, [p.host.ssh for p in probes if _version(p, name) == value])
    return references


def _version(p: _Probe, name: str) -> str | None:
    if p.facts is None:
        return None
    if name == "python":  # patch releases do not matter; the minor version does
        return ".".join(p.facts["python"].split(".")[:2])
    version: str | None = p.facts["versions"].get(name)  # the probe's JSON: a string, or null
    return version


def _versions_check(p: _Probe, references: dict[str, tuple[str, list[str]]]) -> CheckResult:
    installed = " · ".join(f"{name} {_version(p, name) or '-'}" for name in PACKAGES)
    missing = [name for name in PACKAGES if not _version(p, name)]
    if missing:
        return p.result("versions", FAIL, f"{', '.join(missing)} not installed for {p.python} ({installed})",
                        f"pip install {' '.join(missing)} with {p.python}, or point 'python' for {p.host.ssh} "
                        "in the hostfile at the environment that has them")
    if p.facts and p.facts.get("mlx_import"):
        return p.result("versions", FAIL, f"mlx is installed but does not import: {p.facts['mlx_import']}",
                        f"reinstall mlx for {p.python} (pip install --force-reinstall mlx)")
    odd = [(name, _version(p, name), *references[name]) for name in ("python", *PACKAGES)
           if name in references and _version(p, name) != references[name][0]]
    if odd:
        detail = "; ".join(f"{name} {mine} here, {theirs} on {', '.join(hosts)}" for name, mine, theirs, hosts in odd)
        fix = ", ".join(f"{name}=={theirs}" if name != "python" else f"Python {theirs}" for name, _, theirs, _ in odd)
        return p.result("versions", FAIL, f"{detail} (mismatched versions fail at load, e.g. 'Missing N parameters')",
                        f"install the same versions on every host: {fix} on {p.host.ssh}")
    return p.result("versions", OK, installed)


def _ports_check(p: _Probe, all_local: bool, port: int | None, backend: str) -> CheckResult:
    if backend != "ring":
        return p.result("ports", SKIP, f"only the ring backend's ports are checked (backend {backend})")
    if all_local and port is None:
        return p.result("ports", OK, "every rank is local: a free base port is chosen at launch")
    assert p.facts is not None
    busy = [(ip, n, why) for ip, n, why in p.facts.get("ports", []) if why]
    listed = ", ".join(f"{ip}:{n}" for ip, n, _ in p.facts.get("ports", []))
    if not busy:
        return p.result("ports", OK, f"free: {listed}")
    detail = "; ".join(f"{ip}:{n} {why}" for ip, n, why in busy)
    if any("assign" in why.lower() for _, _, why in busy):
        fix = f"list in 'ips' an address of {p.host.ssh} itself, one the other hosts reach it on"
    else:
        fix = f"stop what holds the port on {p.host.ssh} (a previous run?), or pass --port with another base"
    return p.result("ports", FAIL, f"cannot bind {detail}", fix)


def _memory_checks(probes: Sequence[_Probe], hostfile: Hostfile, plan: Plan, meta: ModelMetadata) -> list[CheckResult]:
    """Each machine's ranks against the smaller of its declared and its measured budget."""
    facts = {p.host.ssh: p.facts for p in probes if p.facts and p.facts.get("memory_total")}
    measured_hosts = [_measured(h, facts[h.ssh]) if h.ssh in facts else h for h in hostfile.hosts]
    measured = make_plan(meta, measured_hosts, split=plan.split, context=plan.context, tp=plan.tp)
    results, seen = [], set()
    for p in probes:
        if p.host.ssh in seen or p.host.ssh not in facts:
            continue
        seen.add(p.host.ssh)
        ranks = [h.rank for h in hostfile.hosts if h.ssh == p.host.ssh]
        results.append(_memory_check(p, ranks, plan, measured, facts[p.host.ssh]))
    return results


def _measured(host: Host, facts: dict[str, Any]) -> Host:
    total = facts["memory_total"] / GB
    if facts.get("system") == "Darwin":
        wired = facts["wired_limit"] / GB if facts.get("wired_limit") else None
    else:
        wired = total  # no GPU wiring off macOS: mlx's CPU backend may use all of RAM
    return replace(host, memory_gb=total, wired_limit_gb=wired)


def _memory_check(p: _Probe, ranks: list[int], plan: Plan, measured: Plan, facts: dict[str, Any]) -> CheckResult:
    mine = [measured.ranks[r] for r in ranks]
    # budget - headroom = weights + runtime overhead + KV cache at the planned context.
    need = sum(r.budget_bytes - r.headroom_bytes for r in mine
               if r.budget_bytes is not None and r.headroom_bytes is not None)
    budget, source = mine[0].budget_bytes or 0, _measured_source(facts)
    declared = plan.ranks[ranks[0]].budget_bytes
    host = p.hosts[0]
    if declared is not None and declared < budget:
        budget, source = declared, _declared_source(host)
    label = f"ranks {','.join(map(str, ranks))} need" if len(ranks) > 1 else f"rank {ranks[0]} needs"
    detail = f"{label} {_size(need)} at --context {plan.context}; budget {_size(budget)} ({source})"
    if need > budget:
        fix = (f"this split fits the declared memory: --split {','.join(map(str, plan.suggested_split))}"
               if plan.suggested_split else
               "add hosts or memory, use a more quantized model, or a shorter --context")
        return CheckResult(host.ssh, tuple(ranks), "memory", FAIL, detail, fix)
    real = facts["memory_total"]
    if host.memory_gb and host.memory_gb * GB > real * 1.05:
        return CheckResult(host.ssh, tuple(ranks), "memory", WARN,
                           f"the hostfile says memory_gb {host.memory_gb:g} but {host.ssh} has {_size(real)}; {detail}",
                           f"set memory_gb for {host.ssh} to {real / GB:.0f}")
    available = facts.get("memory_available")
    if available is not None and need > available:
        return CheckResult(host.ssh, tuple(ranks), "memory", WARN, f"{detail}; only {_size(available)} free now",
                           f"close other programs on {host.ssh}")
    return CheckResult(host.ssh, tuple(ranks), "memory", OK, detail)


def _measured_source(facts: dict[str, Any]) -> str:
    if facts.get("system") == "Darwin":
        if facts.get("wired_limit"):
            return "iogpu.wired_limit_mb"
        return f"macOS's default GPU share of {_size(facts['memory_total'])}"
    return f"{_size(facts['memory_total'])} RAM"


def _declared_source(host: Host) -> str:
    if host.wired_limit_gb:
        return f"wired_limit_gb {host.wired_limit_gb:g} in the hostfile"
    return f"memory_gb {host.memory_gb:g} in the hostfile"


def _disk_checks(probes: Sequence[_Probe]) -> list[CheckResult]:
    results = []
    for p in probes:
        if p.facts is None:
            continue
        for directory, files in p.files.items():
            results.append(_disk_check(p, directory, files))
    return results


def _disk_check(p: _Probe, directory: str, files: dict[str, int]) -> CheckResult:
    assert p.facts is not None
    ranks = tuple(p.file_ranks[directory])
    total = sum(files.values())
    missing = total - p.facts["present"].get(directory, 0)
    where = p.facts["disk"].get(directory)
    if missing <= 0:
        status, detail, fix = OK, f"all {len(files)} files present in {directory} ({_size(total)})", None
    elif where is None:
        status, detail, fix = WARN, f"{_size(missing)} to download; cannot read free space at {directory}", None
    elif missing > where[1]:
        status = FAIL
        detail = f"{_size(missing)} still to download to {directory}, only {_size(where[1])} free on {where[0]}"
        fix = f"free space there, or set hf_home (or model_dir) for {p.host.ssh} to a disk with room"
    else:
        status, detail, fix = OK, f"{_size(missing)} to download, {_size(where[1])} free on {where[0]}", None
    return CheckResult(p.host.ssh, ranks, "disk", status, detail, fix)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _size(n: int | float) -> str:
    return human_bytes(n)
