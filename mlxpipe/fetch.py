"""The host side of ``mlxpipe download``: fetch one host's files, verified.

Runs on each host (``python -m mlxpipe.fetch --job <base64>``) and reports
progress as protocol events. Files land through huggingface_hub in the
standard cache layout (or a plain ``local_dir``); huggingface_hub writes to an
``.incomplete`` file and renames it when done, so an interrupted transfer
never looks complete, and resumes with a Range request on the next attempt.
Every file fetched is checked against the hub's sha256 before it is kept.
"""

from __future__ import annotations

import argparse
import base64
import errno
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlxpipe import protocol
from mlxpipe.errors import DownloadError, MlxpipeError

ATTEMPTS = 4
BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0)
_HASH_CHUNK = 8 * 1024 * 1024

OnBytes = Callable[[int], None]


@dataclass(frozen=True)
class FetchJob:
    """What one host must fetch."""

    repo: str
    commit: str
    files: tuple[str, ...]
    sizes: dict[str, int] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    hf_home: str | None = None
    local_dir: str | None = None
    host: str = "localhost"

    def encode(self) -> str:
        return base64.b64encode(json.dumps(asdict(self)).encode()).decode()

    @classmethod
    def decode(cls, text: str) -> FetchJob:
        data = json.loads(base64.b64decode(text))
        data["files"] = tuple(data["files"])
        return cls(**data)


@dataclass(frozen=True)
class FetchResult:
    host: str
    path: str
    fetched_bytes: int
    present_bytes: int
    fetched_files: tuple[str, ...]
    present_files: tuple[str, ...]


class _Corrupt(Exception):
    pass


def fetch(job: FetchJob, on_bytes: OnBytes | None = None, on_file: Callable[[str, str, int], None] | None = None) -> FetchResult:
    """Fetch every file of ``job`` that is not already present and verified."""
    fetched: list[str] = []
    present: list[str] = []
    path = ""
    for name in job.files:
        existing = _present(job, name)
        if existing is not None:
            present.append(name)
            path = str(Path(existing).parent) if "/" not in name else path
            if on_file:
                on_file(name, "present", job.sizes.get(name, 0))
            continue
        file_path = _fetch_one(job, name, on_bytes)
        if "/" not in name:
            path = str(Path(file_path).parent)
        fetched.append(name)
        if on_file:
            on_file(name, "fetched", job.sizes.get(name, 0))
    return FetchResult(
        host=job.host,
        path=path or snapshot_dir(job),
        fetched_bytes=sum(job.sizes.get(f, _size_on_disk(job, f)) for f in fetched),
        present_bytes=sum(job.sizes.get(f, _size_on_disk(job, f)) for f in present),
        fetched_files=tuple(fetched),
        present_files=tuple(present),
    )


def snapshot_dir(job: FetchJob) -> str:
    if job.local_dir:
        return str(Path(job.local_dir).expanduser())
    return str(_cache_dir(job) / ("models--" + job.repo.replace("/", "--")) / "snapshots" / job.commit)


def _cache_dir(job: FetchJob) -> Path:
    from huggingface_hub import constants

    home = job.hf_home or os.environ.get("HF_HOME")
    return Path(home).expanduser() / "hub" if home else Path(constants.HF_HUB_CACHE)


def _present(job: FetchJob, name: str) -> str | None:
    """The file's path when it is already complete on this host."""
    path = Path(snapshot_dir(job)) / name
    if not path.is_file():
        return None
    expected = job.sizes.get(name)
    if expected is not None and path.stat().st_size != expected:
        return None
    return str(path)


def _size_on_disk(job: FetchJob, name: str) -> int:
    path = Path(snapshot_dir(job)) / name
    return path.stat().st_size if path.exists() else 0


def _fetch_one(job: FetchJob, name: str, on_bytes: OnBytes | None) -> str:
    """Download one file with bounded retries; a corrupt file is never kept."""
    from huggingface_hub import hf_hub_download

    from mlxpipe.hub import hub_errors

    last: BaseException | None = None
    for attempt in range(ATTEMPTS):
        try:
            with hub_errors(job.repo, job.host):
                path = hf_hub_download(
                    job.repo, name, revision=job.commit, cache_dir=None if job.local_dir else _cache_dir(job),
                    local_dir=Path(job.local_dir).expanduser() if job.local_dir else None,
                    tqdm_class=_progress_class(on_bytes), force_download=attempt > 0 and isinstance(last, _Corrupt),
                )
            _verify(job, name, path)
            return path
        except _Corrupt as e:
            last = e
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(
                    f"{job.host}: disk full while writing {name} under {snapshot_dir(job)}",
                    "free space on that host (or point hf_home/model_dir at a larger disk) and run download again",
                ) from None
            if not _transient(e):
                raise
            last = e
        except MlxpipeError as e:
            if "cannot reach" not in e.message and "answered an error" not in e.message:
                raise
            last = e
        if attempt + 1 < ATTEMPTS:
            time.sleep(BACKOFF_SECONDS[attempt])
    if isinstance(last, _Corrupt):
        raise DownloadError(
            f"{job.host}: {job.repo}/{name} does not match the hub's sha256 after {ATTEMPTS} attempts; it was removed",
            "the hub or a proxy is serving bad data; try again later",
        )
    raise DownloadError(f"{job.host}: could not fetch {job.repo}/{name} after {ATTEMPTS} attempts ({last})")


def _transient(e: OSError) -> bool:
    name = type(e).__module__
    return name.startswith(("httpx", "httpcore", "requests", "urllib3")) or isinstance(
        e, (ConnectionError, TimeoutError, socket.timeout)
    )


def _verify(job: FetchJob, name: str, path: str) -> None:
    """Check the file against the hub's sha256; remove it if it differs."""
    expected = job.sha256.get(name)
    if not expected:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        real = Path(path).resolve()
        Path(path).unlink(missing_ok=True)
        real.unlink(missing_ok=True)
        raise _Corrupt(name)


def _progress_class(on_bytes: OnBytes | None) -> Any:
    """A tqdm class that forwards byte counts to ``on_bytes`` and draws nothing."""
    from tqdm.auto import tqdm

    class _Forward(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if on_bytes and n:
                on_bytes(int(n))
            return super().update(n)

    return _Forward


# --- Entry point on a host ------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxpipe.fetch")
    parser.add_argument("--job", required=True, help="base64 FetchJob")
    args = parser.parse_args(argv)
    job = FetchJob.decode(args.job)
    last_report = [0.0, 0]

    def on_bytes(n: int) -> None:
        last_report[1] += n
        now = time.monotonic()
        if now - last_report[0] > 0.2:
            protocol.emit("progress", bytes=last_report[1])
            last_report[0], last_report[1] = now, 0

    def on_file(name: str, status: str, size: int) -> None:
        if last_report[1]:
            protocol.emit("progress", bytes=last_report[1])
            last_report[1] = 0
        protocol.emit("file", name=name, status=status, bytes=size)

    try:
        result = fetch(job, on_bytes, on_file)
    except MlxpipeError as e:
        protocol.emit("error", host=job.host, message=e.message, hint=e.hint)
        return 1
    except Exception as e:  # noqa: BLE001 - reported to the controller, then re-raised
        protocol.emit("error", host=job.host, message=f"{type(e).__name__}: {e}", hint=None)
        raise
    protocol.emit("done", **asdict(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
