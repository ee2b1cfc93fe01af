"""All Hugging Face Hub access: model metadata (headers only) and error mapping.

Everything goes through huggingface_hub, so the standard cache, ``HF_HOME``,
``HF_ENDPOINT`` and the user's login apply. Metadata fetched once is cached
under ``mlxpipe_home()/metadata`` by commit, so a second ``plan`` of the same
revision makes no network call.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from mlxpipe.errors import HubError, ModelError
from mlxpipe.metadata import (
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
from mlxpipe.paths import mlxpipe_home

Progress = Callable[[int, int], None]  # (done, total)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HEADER_WORKERS = 8


def load_metadata(
    model: str, revision: str | None = None, *, refresh: bool = False, progress: Progress | None = None
) -> ModelMetadata:
    """Describe ``model`` (a local directory or a hub repo id) without its weights."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            raise HubError(f"--revision applies to hub repos, but {model} is a local directory")
        return load_local(path)
    if not _REPO_ID.match(model) or model.startswith((".", "/", "~")):
        raise ModelError(
            f"{model}: no such directory, and not a hub repo id",
            "pass a local model directory or a repo id such as mlx-community/Llama-3.3-70B-Instruct-4bit",
        )
    rev = revision or "main"
    if not refresh:
        cached = _cached(model, rev)
        if cached is not None:
            return cached
    meta = _fetch(model, rev, progress)
    _store(meta, rev)
    return meta


@contextmanager
def hub_errors(repo: str, host: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line ``HubError``s naming the repo."""
    from huggingface_hub import errors as hf

    where = f" (on {host})" if host else ""
    login = "log in with `hf auth login` or set HF_TOKEN" + (f" on {host}" if host else "")
    try:
        yield
    except hf.GatedRepoError:
        raise HubError(
            f"{repo} is gated{where}: you must accept its terms and be logged in",
            f"accept the terms on the model's page, then {login}",
        ) from None
    except hf.RepositoryNotFoundError:
        raise HubError(
            f"{repo}: no such model repo on {_endpoint()}{where}, or it is private",
            f"check the name; if it is private, {login}",
        ) from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{repo}: no such revision{where}", "check --revision") from None
    except hf.LocalEntryNotFoundError:
        raise HubError(
            f"{repo}: not in the local cache and the hub at {_endpoint()} cannot be reached{where}",
            "check the network (or HF_ENDPOINT), or download the model first",
        ) from None
    except hf.EntryNotFoundError as e:
        raise HubError(f"{repo}: file missing from the repo{where} ({_short(e)})") from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"{repo}: access refused ({status}){where}", login) from None
        raise HubError(f"{repo}: the hub answered an error{where}: {_short(e)}") from None
    except OSError as e:
        if type(e).__module__.startswith(("httpx", "requests", "urllib3")) or "connect" in str(e).lower():
            raise HubError(f"{repo}: cannot reach the hub at {_endpoint()}{where} ({_short(e)})") from None
        raise


def _endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _fetch(repo: str, revision: str, progress: Progress | None) -> ModelMetadata:
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    with hub_errors(repo):
        info = api.model_info(repo, revision=revision, files_metadata=True)
        commit = info.sha
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        hashes = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.lfs and s.lfs.sha256}
        config = read_json(Path(hf_hub_download(repo, "config.json", revision=commit)), repo)
        if WEIGHT_INDEX in sizes:
            index = read_json(Path(hf_hub_download(repo, WEIGHT_INDEX, revision=commit)), repo)
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


def _fetch_headers(api: Any, repo: str, commit: str, files: list[str], progress: Progress | None) -> list[Tensor]:
    """Read every shard's header with Range requests, in parallel."""
    done = 0

    def one(name: str) -> list[Tensor]:
        meta = api.parse_safetensors_file_metadata(repo, name, revision=commit)
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
    return mlxpipe_home() / "metadata" / ("models--" + repo.replace("/", "--"))


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


def _store(meta: ModelMetadata, revision: str) -> None:
    d = _cache_dir(meta.source)
    (d / "refs").mkdir(parents=True, exist_ok=True)
    _write_atomic(d / f"{meta.commit}.json", json.dumps(meta.to_json()))
    _write_atomic(d / "refs" / revision, str(meta.commit))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
