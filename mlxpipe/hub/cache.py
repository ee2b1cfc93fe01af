"""Where the Hugging Face cache keeps a repo on a host, and whether the hub may be asked at all.

huggingface_hub's own layout (``<HF_HOME>/hub/models--org--name``), so mlx-lm and ``hf``
reuse what mlxpipe fetches. Runs on every host (``download.fetch``): stdlib and
huggingface_hub only.
"""

from __future__ import annotations

from pathlib import Path


def hub_cache_dir(hf_home: str | None) -> Path:
    """The hub cache under ``hf_home``, else this machine's default one."""
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(repo: str) -> str:
    """``models--org--name``: a model repo's folder in a hub cache (huggingface_hub's own naming)."""
    from huggingface_hub.file_download import repo_folder_name

    return repo_folder_name(repo_id=repo, repo_type="model")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), as huggingface_hub read it."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())
