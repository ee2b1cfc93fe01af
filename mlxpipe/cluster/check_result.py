"""What one check of ``mlxpipe doctor`` found on one host: its status and, when it failed, the fix.

The doctor's host checks (``cluster/doctor.py``) and the layout's (``cluster/layout_checks.py``) report alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class CheckResult:
    """One check on one host: what was found and, when it failed, what to do."""

    host: str  # the ssh destination
    ranks: tuple[int, ...]
    check: str  # ssh, python, versions, ports, memory, disk
    status: str  # ok, warn, fail, skip
    detail: str
    fix: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranks"] = list(self.ranks)
        return data
