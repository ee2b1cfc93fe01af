"""The ``mlx.launch`` command line that starts a run's ranks: what to start (``LaunchSpec``), the exact argv, the
ring's first port, the supervisor's lease and the run directory.

Every rank runs under its supervisor (``python -m mlxpipe.launch.supervisor --lease S -- <worker args>``),
with its host's interpreter; ``mlx.launch`` itself is run by this interpreter through
``launch/mlx_launch.py``. ``launch/ranks.py`` starts the command and owns what it starts.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlxpipe.cluster import remote
from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.defaults import DEFAULT_PORT
from mlxpipe.errors import LaunchError
from mlxpipe.launch import mlx_launch
from mlxpipe.launch.supervisor import MAX_LEASE_SECONDS
from mlxpipe.paths import mlxpipe_home

# The lease follows the watchdog (--timeout), within these bounds.
MIN_LEASE_SECONDS = 5.0


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start the ranks."""

    hostfile: Hostfile
    worker_args: tuple[str, ...]  # after the interpreter: ("-m", "mlxpipe.worker", ...)
    backend: str = "ring"
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    lease: float = MAX_LEASE_SECONDS
    run_dir: Path = field(default_factory=lambda: new_run_dir())


def lease_for(timeout: float) -> float:
    """The lease for a run whose watchdog is ``timeout`` seconds."""
    return min(max(timeout, MIN_LEASE_SECONDS), MAX_LEASE_SECONDS)


def new_run_dir() -> Path:
    """A fresh directory for this run's hostfile, command and logs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = mlxpipe_home() / "runs" / f"{stamp}-{os.getpid()}-{threading.get_ident() % 10000}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def mlx_launch_command() -> list[str]:
    """``mlx.launch``, run by this interpreter with its I/O threads made to sleep (``launch/mlx_launch.py``)."""
    try:
        found = importlib.util.find_spec("mlx._distributed_utils.launch") is not None
    except ModuleNotFoundError:  # no mlx at all
        found = False
    if not found:
        raise LaunchError("mlx.launch not found", "install mlx (pip install mlx) in this environment")
    return [sys.executable, "-m", mlx_launch.LAUNCHER]


def launch_argv(spec: LaunchSpec) -> list[str]:
    """The exact ``mlx.launch`` command line for ``spec`` (also written to the run dir)."""
    hostfile_path = spec.run_dir / "hostfile.json"
    # --verbose makes mlx.launch report ranks that exit 0, which it otherwise ignores.
    argv = [*mlx_launch_command(), "--verbose", "--hostfile", str(hostfile_path), "--backend", spec.backend]
    for key, value in spec.env:
        argv += ["--env", f"{key}={value}"]
    argv += ["--starting-port", str(spec.port or default_port(spec.hostfile))]
    return argv + ["--", *rank_command(spec)]


def rank_command(spec: LaunchSpec) -> list[str]:
    """The command every rank runs: the supervisor, which runs the worker with the same interpreter.

    Per-host interpreters are chosen by ``$MLX_RANK``; mlx.launch quotes every argument.
    """
    supervised = ["-m", "mlxpipe.launch.supervisor", "--lease", f"{spec.lease:g}", "--", *spec.worker_args]
    pythons = [remote.python_for(h) for h in spec.hostfile.hosts]
    if len(set(pythons)) == 1:
        return [pythons[0], *supervised]
    cases = " ".join(f'{r}) exec {shlex.quote(p)} "$@";;' for r, p in enumerate(pythons))
    return ["/bin/sh", "-c", f'case "$MLX_RANK" in {cases} esac; exit 127', "mlxpipe-rank", *supervised]


def default_port(hostfile: Hostfile) -> int:
    """mlx.launch's port on real clusters; a free one when every rank is on this machine."""
    if all(h.is_local for h in hostfile.hosts):
        return free_port_base(sum(max(1, len(h.ips)) for h in hostfile.hosts))
    return DEFAULT_PORT


def free_port_base(count: int) -> int:
    """A base port with ``count`` free ports after it (for ranks on this machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + count < 65000 and all(_port_free(base + i) for i in range(count)):
            return base
    return DEFAULT_PORT


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
