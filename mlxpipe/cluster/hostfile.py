"""Hostfiles: which machines run the ranks, and what mlxpipe knows about them (``mlxpipe.host.Host``).

mlxpipe reads ``mlx.launch``'s own JSON hostfile unchanged (a list of hosts,
or an object with ``backend``, ``envs`` and ``hosts``), so the output of
``mlx.distributed_config`` works as is; rank i is the i-th host. The same
structure may be written in YAML. mlxpipe adds optional per-host keys, which
``mlx.launch`` ignores:

* ``memory_gb``: the host's memory (RAM) in GB.
* ``wired_limit_gb``: what the GPU may wire on that Mac (``sysctl
  iogpu.wired_limit_mb``); by default macOS wires only part of RAM.
* ``hf_home`` or ``model_dir``: where that host keeps weights.
* ``python``: the interpreter to run on that host.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlxpipe.errors import HostfileError, UsageError
from mlxpipe.host import Host
from mlxpipe.paths import read_users_text

BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi", "nccl")

# An ssh destination: user@host, a name or an address. Never a leading "-",
# which ssh would read as an option, and no shell metacharacters (matched whole:
# "$" alone would let a trailing newline through).
_SSH_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.+-]*@)?[A-Za-z0-9_:.\[\]%][A-Za-z0-9_:.\[\]%-]*")
_KNOWN_KEYS = {
    "ssh", "ips", "rdma", "memory_gb", "wired_limit_gb", "hf_home", "model_dir", "python",
}


def check_port(port: int | None, flag: str | None = None) -> int | None:
    """``port`` as given when it is a TCP port (or None); else ``UsageError``, naming ``flag`` when given."""
    if port is not None and not 0 < port < 65536:
        raise UsageError(_named(flag, f"{port} is not a TCP port (1-65535)"))
    return port


def check_backend(backend: str | None, flag: str | None = None) -> str | None:
    """``backend`` as given when mlx.launch has it (or None); else ``UsageError``, naming ``flag`` when given."""
    if backend is not None and backend not in BACKENDS:
        raise UsageError(_named(flag, f"{backend!r}: use one of {', '.join(BACKENDS)}"))
    return backend


def _named(flag: str | None, problem: str) -> str:
    # Typer's callbacks name the flag themselves ("Invalid value for '--port': ..."); the rest say it first.
    return f"{flag} {problem}" if flag else problem


@dataclass(frozen=True)
class Hostfile:
    """A parsed, validated hostfile."""

    path: Path
    hosts: tuple[Host, ...]
    backend: str = ""
    envs: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.hosts)

    def memory_declared(self) -> bool:
        """Every host declares ``memory_gb``."""
        return all(h.memory_gb is not None for h in self.hosts)

    def to_mlx_launch(self) -> dict[str, Any]:
        """The JSON ``mlx.launch --hostfile`` reads (mlxpipe's keys dropped)."""
        hosts = []
        for h in self.hosts:
            entry: dict[str, Any] = {"ssh": h.ssh, "ips": list(h.ips)}
            if h.rdma:
                entry["rdma"] = list(h.rdma)
            hosts.append(entry)
        return {"backend": self.backend, "envs": list(self.envs), "hosts": hosts}


def load_hostfile(path: str | Path) -> Hostfile:
    """Read and validate a JSON or YAML hostfile."""
    path = Path(path)
    data = _read(path)
    return parse_hostfile(data, path)


def parse_hostfile(data: Any, path: Path) -> Hostfile:
    """Validate already-decoded hostfile data; errors name ``path``."""
    backend: Any = ""
    envs: Any = []
    if isinstance(data, dict):
        unknown = set(data) - {"backend", "envs", "hosts"}
        if unknown:
            raise HostfileError(
                f"{path}: unknown top-level key {sorted(unknown)[0]!r}",
                "the top level may hold 'backend', 'envs' and 'hosts'",
            )
        if "hosts" not in data:
            raise HostfileError(f"{path}: no 'hosts' list", "add 'hosts': [{\"ssh\": ...}, ...]")
        backend, envs, raw_hosts = data.get("backend") or "", data.get("envs") or [], data["hosts"]
    elif isinstance(data, list):
        raw_hosts = data
    else:
        raise HostfileError(
            f"{path}: expected a list of hosts or an object with 'hosts'",
            "see hostfiles/local-2.json for the format",
        )
    if not isinstance(backend, str) or (backend and backend not in BACKENDS):
        raise HostfileError(
            f"{path}: unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}"
        )
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError(f"{path}: 'envs' must be a list of 'NAME=value' strings")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise HostfileError(f"{path}: 'hosts' must be a non-empty list")
    hosts = tuple(_parse_host(path, i, h) for i, h in enumerate(raw_hosts))
    if backend in ("", "ring"):
        for h in hosts:
            if not h.ips:
                raise HostfileError(
                    f"{path}: host {h.rank} ({h.ssh}) has no 'ips', which the ring backend needs",
                    'add "ips": ["<address the other hosts reach it on>"]',
                )
    return Hostfile(path=path, hosts=hosts, backend=backend, envs=tuple(envs))


def _read(path: Path) -> Any:
    text = read_users_text(path, HostfileError, "hostfile", "pass --hostfile with an existing file",
                           "a hostfile is JSON or YAML text")
    try:
        if path.suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise HostfileError(f"{path}: not valid {kind} ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]


def _parse_host(path: Path, rank: int, raw: Any) -> Host:
    where = f"{path}: host {rank}"
    if not isinstance(raw, dict):
        raise HostfileError(f"{where}: expected an object with 'ssh', got {type(raw).__name__}")
    ssh = raw.get("ssh")
    if ssh is None or ssh == "":
        raise HostfileError(f"{where}: missing 'ssh'", 'add "ssh": "<hostname>" (127.0.0.1 runs locally)')
    if not isinstance(ssh, str):
        raise HostfileError(f"{where}: 'ssh' must be a host name string, got {ssh!r}")
    if not _SSH_RE.fullmatch(ssh):
        raise HostfileError(
            f"{where}: 'ssh' value {ssh!r} is not a host name",
            "use a plain host name, user@host or an address",
        )
    where = f"{path}: host {rank} ({ssh})"
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise HostfileError(
            f"{where}: unknown key {sorted(unknown)[0]!r}",
            f"known keys: {', '.join(sorted(_KNOWN_KEYS))}",
        )
    ips = raw.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostfileError(f"{where}: 'ips' must be a list of addresses")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise HostfileError(f"{where}: 'ips' entry {ip!r} is not an IP address") from None
    rdma = raw.get("rdma", [])
    if not isinstance(rdma, list):
        raise HostfileError(f"{where}: 'rdma' must be a list")
    return Host(
        rank=rank,
        ssh=ssh,
        ips=tuple(ips),
        rdma=tuple(rdma),
        memory_gb=_positive(raw, "memory_gb", where),
        wired_limit_gb=_positive(raw, "wired_limit_gb", where),
        hf_home=_string(raw, "hf_home", where),
        model_dir=_string(raw, "model_dir", where),
        python=_string(raw, "python", where),
    )


def _positive(raw: dict[str, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HostfileError(f"{where}: '{key}' must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:  # JSON and YAML both accept NaN and infinity
        raise HostfileError(f"{where}: '{key}' must be positive, got {value}")
    return float(value)


def _string(raw: dict[str, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\n" in value or "\0" in value:
        raise HostfileError(f"{where}: '{key}' must be a non-empty path string")
    return value
