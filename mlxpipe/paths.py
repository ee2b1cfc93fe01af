"""Where mlxpipe keeps its own files, how it replaces one whole, and how it reads a file the user names."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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


def read_users_text(path: Path, error: Callable[..., Exception], what: str, missing_hint: str, text_hint: str) -> str:
    """The text of a file the user named (a hostfile, a fleet file), or ``error`` (an ``MlxpipeError`` class,
    called with a message and a hint) in one line naming ``path``: ``no such {what}`` (with ``missing_hint``),
    ``cannot read {what}`` (the system's reason), or ``not a text file`` (with ``text_hint``)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise error(f"{path}: no such {what}", missing_hint) from None
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file", text_hint) from None
