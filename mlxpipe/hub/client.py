"""All Hugging Face Hub access: model metadata (headers only), cached by commit.

Everything goes through huggingface_hub, so the standard cache, ``HF_HOME``,
``HF_ENDPOINT`` and the user's login apply. Metadata fetched once is cached
under ``mlxpipe_home()/metadata`` by commit, so a second ``plan`` of the same
revision makes no network call.

Errors are mapped by ``hub.faults`` (one line naming the host that failed and what to do).
Every request has a timeout (``HF_HUB_ETAG_TIMEOUT``, 10 s by default), so a
hub that accepts connections and never answers fails instead of hanging.
With ``HF_HUB_OFFLINE=1`` (or when the hub cannot be reached) metadata comes
from the caches alone: mlxpipe's, then the Hugging Face cache's refs and
snapshots, as huggingface_hub resolves a branch offline.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpipe.errors import HubError, HubUnreachable, ModelError
from mlxpipe.hub.cache import hub_cache_dir, offline, repo_folder
from mlxpipe.hub.faults import hub_errors
from mlxpipe.model.metadata import (
    SINGLE_WEIGHTS,
    WEIGHT_INDEX,
    ModelMetadata,
    Tensor,
    check_repo_filename,
    is_support_file,
    load_local,
    read_json,
    weight_map,
)
from mlxpipe.paths import mlxpipe_home, write_atomic

if TYPE_CHECKING:
    from huggingface_hub import HfApi

Progress = Callable[[int, int], None]  # (done, total)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HEADER_WORKERS = 8


def is_repo_id(text: str) -> bool:
    """``text`` names a hub repo (``org/name``), not a path."""
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "/", "~"))


def load_metadata(
    model: str, revision: str | None = None, *, refresh: bool = False, progress: Progress | None = None
) -> ModelMetadata:
    """Describe ``model`` (a local directory or a hub repo id) without its weights."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            raise HubError(f"--revision applies to hub repos, but {model} is a local directory")
        return load_local(path)
    if not is_repo_id(model):
        raise ModelError(
            f"{model}: no such directory, and not a hub repo id",
            "pass a local model directory or a repo id such as mlx-community/Llama-3.3-70B-Instruct-4bit",
        )
    rev = revision or "main"
    if offline():
        if refresh:
            raise HubUnreachable(
                f"{model}: --refresh reads the hub, but HF_HUB_OFFLINE=1 forbids it",
                "drop --refresh to use the cached metadata, or unset HF_HUB_OFFLINE",
            )
        return _cached_offline(model, rev) or _raise_not_cached(model, revision)
    if not refresh:
        cached = _cached(model, rev)
        if cached is not None:
            return cached
    try:
        meta = _fetch(model, rev, progress)
    except HubUnreachable:
        # As huggingface_hub does: a hub that cannot be reached leaves what is cached usable.
        fallback = None if refresh else _cached_offline(model, rev)
        if fallback is None:
            raise
        return fallback
    _store(meta, rev)
    return meta


def request_timeout() -> float:
    """Seconds any one metadata request may wait for the hub: ``HF_HUB_ETAG_TIMEOUT`` (10 by default).

    Read at each call, not at import, and passed explicitly: huggingface_hub's
    own client has no timeout, so a port that accepts and never answers would hang.
    """
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


def download_file(repo: str, filename: str, revision: str | None, **kwargs: Any) -> str:
    """``hf_hub_download`` with a bounded wait when the hub is down.

    When a file is not cached and its first HEAD fails on the network or with a
    5xx, ``hf_hub_download`` retries it with a 60 s timeout and five backoffs
    (minutes for a silent hub). A cached file is returned without a request; for
    any other, one HEAD with ``request_timeout()`` and no retry goes first, so a
    dead hub fails here, in seconds, and callers retry as they see fit.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache

    if not kwargs.get("local_dir") and not kwargs.get("force_download"):
        cached = try_to_load_from_cache(repo, filename, cache_dir=kwargs.get("cache_dir"), revision=revision)
        if isinstance(cached, str):
            return cached
    if not offline():
        get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision), timeout=request_timeout())
    path: str = hf_hub_download(repo, filename, revision=revision, etag_timeout=request_timeout(), **kwargs)
    return path


def _fetch(repo: str, revision: str, progress: Progress | None) -> ModelMetadata:
    from huggingface_hub import HfApi

    api = HfApi()
    with hub_errors(repo):
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=request_timeout())
        commit = info.sha
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        hashes = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.lfs and s.lfs.sha256}
        config = read_json(Path(download_file(repo, "config.json", commit)), repo)
        if WEIGHT_INDEX in sizes:
            index = read_json(Path(download_file(repo, WEIGHT_INDEX, commit)), repo)
            files = sorted(set(weight_map(index, repo).values()))
        elif SINGLE_WEIGHTS in sizes:
            files = [SINGLE_WEIGHTS]
        else:
            raise ModelError(
                f"{repo}: neither {WEIGHT_INDEX} nor {SINGLE_WEIGHTS} in the repo",
                "mlxpipe reads safetensors checkpoints (an mlx-community conversion works)",
            )
        for f in files:
            check_repo_filename(f, repo)
            if f not in sizes:
                raise ModelError(f"{repo}: the weight index names {f}, which the repo lacks")
        tensors = _fetch_headers(api, repo, commit, files, progress)
    support = tuple(sorted(f for f in sizes if is_support_file(f) and "/" not in f))
    return ModelMetadata(
        source=repo, config=config, tensors=tuple(tensors), file_sizes=sizes,
        revision=revision, commit=commit, support_files=support, file_sha256=hashes,
    )


def _fetch_headers(
    api: HfApi, repo: str, commit: str | None, files: list[str], progress: Progress | None
) -> list[Tensor]:
    """Read every shard's header with Range requests, in parallel."""
    done = 0

    def one(name: str) -> list[Tensor]:
        meta = api.parse_safetensors_file_metadata(repo, name, revision=commit, timeout=request_timeout())
        return [Tensor(t, info.dtype, tuple(info.shape), name) for t, info in meta.tensors.items()]

    tensors: list[Tensor] = []
    with ThreadPoolExecutor(_HEADER_WORKERS) as pool:
        for chunk in pool.map(one, files):
            tensors.extend(chunk)
            done += 1
            if progress:
                progress(done, len(files))
    return tensors


# --- The metadata cache: metadata/<repo>/refs/<revision> -> commit, <commit>.json ----


def _cache_dir(repo: str) -> Path:
    return mlxpipe_home() / "metadata" / repo_folder(repo)


def _cached(repo: str, revision: str) -> ModelMetadata | None:
    d = _cache_dir(repo)
    ref = d / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    entry = d / f"{commit}.json"
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not entry.is_file():
        return None
    try:
        return ModelMetadata.from_json(json.loads(entry.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged cache entry is refetched


def _cached_offline(repo: str, revision: str) -> ModelMetadata | None:
    """Metadata without the hub: mlxpipe's cache, found by its own ref or by huggingface_hub's.

    ``refs/<branch>`` in the Hugging Face cache is how huggingface_hub (and mlx-lm)
    resolve a branch offline; a snapshot holding the whole checkpoint (downloaded
    by ``hf download`` or mlx-lm) is read like a local directory.
    """
    cached = _cached(repo, revision)
    if cached is not None:
        return cached
    commit = _hf_commit(repo, revision)
    if commit is None:
        return None
    return _cached(repo, commit) or _from_hf_snapshot(repo, revision, commit)


def _hf_commit(repo: str, revision: str) -> str | None:
    """The commit huggingface_hub's cache resolves ``revision`` to on this machine, if any."""
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    ref = _hf_repo_dir(repo) / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def _hf_repo_dir(repo: str) -> Path:
    return hub_cache_dir(None) / repo_folder(repo)


def _from_hf_snapshot(repo: str, revision: str, commit: str) -> ModelMetadata | None:
    """The metadata of a complete snapshot in the Hugging Face cache, or None if it lacks a file."""
    snapshot = _hf_repo_dir(repo) / "snapshots" / commit
    if not (snapshot / "config.json").is_file():
        return None
    try:
        local = load_local(snapshot)
    except (ModelError, OSError):
        return None  # a rank's share of the files, not the whole checkpoint
    hashes = {name: sha for name in local.weight_files if (sha := _blob_sha256(snapshot / name))}
    return ModelMetadata(
        source=repo, config=local.config, tensors=local.tensors, file_sizes=local.file_sizes,
        revision=revision, commit=commit, support_files=local.support_files, file_sha256=hashes,
    )


def _blob_sha256(entry: Path) -> str | None:
    """The sha256 an LFS file's cache blob is named after (the hub's hash, known offline), else None."""
    if not entry.is_symlink():
        return None
    name = Path(os.readlink(entry)).name
    return name if re.fullmatch(r"[0-9a-f]{64}", name) else None


def _raise_not_cached(repo: str, revision: str | None) -> ModelMetadata:
    """Offline with nothing cached: say what is missing and how to get it."""
    rev = revision or "main"
    commit = _hf_commit(repo, rev)
    known = f" (commit {commit[:12]})" if commit and commit != rev else ""
    flag = f" --revision {revision}" if revision else ""
    raise HubUnreachable(
        f"offline (HF_HUB_OFFLINE=1) and no cached metadata for {repo} at revision {rev}{known}",
        f"run `mlxpipe plan --model {repo}{flag}` once online",
    )


def _store(meta: ModelMetadata, revision: str) -> None:
    d = _cache_dir(meta.source)
    (d / "refs").mkdir(parents=True, exist_ok=True)
    write_atomic(d / f"{meta.commit}.json", json.dumps(meta.to_json()))
    write_atomic(d / "refs" / revision, str(meta.commit))
