"""mlxpipe: pipeline-parallel LLM inference across Apple Silicon machines."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """``mlxpipe.__version__``: the installed package's version, read from its metadata on first use.

    pyproject.toml's ``version`` is the one place the version is written; `mlxpipe --version` reads the same metadata.
    """
    if name == "__version__":
        from importlib.metadata import version

        return version("mlxpipe")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
