"""Where mlxpipe keeps its own files, and how it replaces one whole."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def mlxpipe_home() -> Path:
    """``$MLXPIPE_HOME``, else ``~/.cache/mlxpipe``."""
    env = os.environ.get("MLXPIPE_HOME")
    return Path(env) if env else Path.home() / ".cache" / "mlxpipe"


@contextmanager
def replacing(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside ``path`` to write; it replaces ``path`` in one step once the block ends.

    A crash or an error part-way leaves the old file as it was (the temporary one is removed).
    ``suffix`` keeps the extension where a writer insists on it (``mx.save_safetensors``).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    with replacing(path) as tmp:
        tmp.write_text(text)
