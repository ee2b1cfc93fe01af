"""Where mlxpipe keeps its own files."""

from __future__ import annotations

import os
from pathlib import Path


def mlxpipe_home() -> Path:
    """``$MLXPIPE_HOME``, else ``~/.cache/mlxpipe``."""
    env = os.environ.get("MLXPIPE_HOME")
    return Path(env) if env else Path.home() / ".cache" / "mlxpipe"
