"""One rank's machine, as plain data: what the planner, the doctor, downloads and launches share.

A leaf: the hostfile parser (``cluster/hostfile.py``) makes these from a file, and the pure
planner (``plan/``) reads them without importing the parser, so the two rooms do not import
each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOCAL_HOST = "127.0.0.1"  # the ssh destination mlx.launch starts without ssh
GB = 1024**3  # bytes in one of a host's memory_gb (and wired_limit_gb)


@dataclass(frozen=True)
class Host:
    """One rank's machine."""

    rank: int
    ssh: str
    ips: tuple[str, ...] = ()
    rdma: tuple[Any, ...] = ()
    memory_gb: float | None = None
    wired_limit_gb: float | None = None
    hf_home: str | None = None
    model_dir: str | None = None
    python: str | None = None

    @property
    def is_local(self) -> bool:
        """mlx.launch starts this rank without ssh."""
        return self.ssh == LOCAL_HOST

    @property
    def label(self) -> str:
        """A short name for tables and errors: ``rank 1 (studio-2)``."""
        return f"rank {self.rank} ({self.ssh})"
