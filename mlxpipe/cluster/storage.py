"""Where each host keeps the model's files, and the prompt cache's disk tier.

A hub model lives in the host's Hugging Face cache (``hf_home`` from the
hostfile, else the host's default), in the standard layout so mlx-lm and the
``hf`` tools reuse it; or, when the host declares ``model_dir``, in a plain
directory ``<model_dir>/<org>/<name>``. Paths for remote hosts may start with
``~``: they are expanded on that host.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxpipe.defaults import PROMPT_CACHE_UNDER_HF_HOME
from mlxpipe.host import Host
from mlxpipe.hub.cache import repo_folder
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.paths import mlxpipe_home

REMOTE_HF_HOME = "~/.cache/huggingface"
REMOTE_MLXPIPE_HOME = "~/.cache/mlxpipe"


def hf_home(host: Host) -> str:
    """The Hugging Face home on ``host``."""
    if host.hf_home:
        return host.hf_home
    if host.is_local:
        return os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return REMOTE_HF_HOME


def local_dir(host: Host, meta: ModelMetadata) -> str | None:
    """The plain directory the model goes to on ``host``, or None for the HF cache."""
    if meta.local:
        if host.model_dir:
            return f"{host.model_dir.rstrip('/')}/{Path(meta.source).name}"
        if host.is_local:
            return meta.source
        return f"{REMOTE_MLXPIPE_HOME}/models/{Path(meta.source).name}"
    if host.model_dir:
        return f"{host.model_dir.rstrip('/')}/{meta.source}"
    return None


def prompt_cache_dir(host: Host, flag: str | None = None) -> str:
    """Where ``host`` keeps the prompt cache's disk tier: ``--prompt-cache-dir`` (the same path on every host),
    else beside its models when the hostfile gives its ``hf_home``, else in its mlxpipe home."""
    if flag is not None:
        return flag
    if host.hf_home:
        return f"{host.hf_home.rstrip('/')}/{PROMPT_CACHE_UNDER_HF_HOME}"
    if host.is_local:
        return str(mlxpipe_home() / "prompt-cache")
    return f"{REMOTE_MLXPIPE_HOME}/prompt-cache"


def model_path(host: Host, meta: ModelMetadata) -> str:
    """The directory on ``host`` holding config, tokenizer and that host's weights."""
    plain = local_dir(host, meta)
    if plain is not None:
        return plain
    return f"{hf_home(host).rstrip('/')}/hub/{repo_folder(meta.source)}/snapshots/{meta.commit}"
