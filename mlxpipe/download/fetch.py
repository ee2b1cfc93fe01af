"""The host side of ``mlxpipe download``: fetch one host's files, verified.

Runs on each host (``python -m mlxpipe.download.fetch --job <base64>``) and reports
progress as events (``protocol.fetch_events``: mlxpipe is installed there, as on every rank);
``--check`` only reports which files are already there (``download --from-controller``
asks it before sending anything). Files
land through huggingface_hub in the standard cache layout (or a plain
``local_dir``). huggingface_hub writes each file to a temporary name and
renames it when complete, so an interrupted transfer never looks complete, and
a connection dropped mid-file resumes with a Range request. Every file fetched
is checked against the hub's sha256 before it is kept.
"""

from __future__ import annotations

import argparse
import base64
import errno
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mlxpipe.errors import DownloadError, MlxpipeError
from mlxpipe.hub.cache import hub_cache_dir, repo_folder
from mlxpipe.paths import write_atomic
from mlxpipe.protocol import wire
from mlxpipe.protocol.fetch_events import Check, FetchError, Fetching, FetchResult, FileDone

ATTEMPTS = 4
# Seconds to wait before attempts 2, 3 and 4.
BACKOFF_SECONDS = (0.5, 1.0, 2.0)
# No new attempt starts this long after a file's first one (or the last that moved data):
# four attempts at a hub that never answers (each waiting HF_HUB_ETAG_TIMEOUT, 10 s)
# would take 45 s; this stops at ~20.
RETRY_WINDOW_SECONDS = 15.0
_HASH_CHUNK = 8 * 1024 * 1024

OnBytes = Callable[[int], None]
OnFile = Callable[[str, str, int], None]  # (name, "present" | "fetched", bytes)


@dataclass(frozen=True)
class FetchJob:
    """What one host must hold: ``files`` of ``repo`` at ``commit``, in one place.

    ``host`` is a label for messages (``studio-2 (rank 1)``). ``commit`` is None
    for a local model directory, which only ``--check`` and the controller's
    copy handle. ``offline``: the controller runs with ``HF_HUB_OFFLINE=1``, so
    this host must not ask the hub either (ssh does not carry the variable).
    """

    repo: str
    commit: str | None
    files: tuple[str, ...]
    sizes: dict[str, int] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    hf_home: str | None = None
    local_dir: str | None = None
    host: str = "localhost"
    revision: str | None = None
    offline: bool = False

    def __post_init__(self) -> None:
        from mlxpipe.model.metadata import check_repo_filename

        # The job crosses a process (and maybe a network) boundary: never trust its names.
        for name in self.files:
            check_repo_filename(name, self.repo)

    def encode(self) -> str:
        return base64.b64encode(json.dumps(asdict(self)).encode()).decode()

    @classmethod
    def decode(cls, text: str) -> FetchJob:
        data = json.loads(base64.b64decode(text))
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}  # a newer controller may add keys
        data["files"] = tuple(data["files"])
        return cls(**data)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.get(f, 0) for f in self.files)


class _Corrupt(Exception):
    pass


def fetch(job: FetchJob, on_bytes: OnBytes | None = None, on_file: OnFile | None = None) -> FetchResult:
    """Fetch every file of ``job`` that is not already present, verifying each."""
    if not job.commit:
        raise DownloadError(f"{job.host}: {job.repo} is not a hub repo; there is nothing to fetch")
    if is_offline(job):
        _require_present(job)
    fetched: list[str] = []
    present: list[str] = []
    for name in job.files:
        if is_present(job, name):
            present.append(name)
            status = "present"
        else:
            _fetch_one(job, name, on_bytes)
            fetched.append(name)
            status = "fetched"
        if on_file:
            on_file(name, status, job.sizes.get(name, 0))
    if job.files:
        _write_ref(job)
    return FetchResult(
        host=job.host,
        path=model_dir(job),
        fetched_bytes=sum(_size(job, f) for f in fetched),
        present_bytes=sum(_size(job, f) for f in present),
        fetched_files=tuple(fetched),
        present_files=tuple(present),
    )


def is_offline(job: FetchJob) -> bool:
    """The job, or this host's own environment, says not to ask the hub."""
    from mlxpipe.hub.cache import offline

    return job.offline or offline()


def _require_present(job: FetchJob) -> None:
    """Offline: every file must already be here; otherwise say which are not."""
    _, missing = check(job)
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise DownloadError(
        f"{job.host}: offline (HF_HUB_OFFLINE=1) and {len(missing)} of its {len(job.files)} files of {job.repo} "
        f"at commit {str(job.commit)[:12]} are not in {model_dir(job)}: {shown}",
        "run `mlxpipe download` once online, or `mlxpipe download --from-controller` from a machine that has them",
    )


def check(job: FetchJob) -> tuple[list[str], list[str]]:
    """``(present, missing)``: which of the job's files this host already holds."""
    present = [f for f in job.files if is_present(job, f)]
    return present, [f for f in job.files if f not in present]


def model_dir(job: FetchJob) -> str:
    """The directory holding the files: the snapshot in the cache, or ``local_dir``."""
    if job.local_dir:
        return str(Path(job.local_dir).expanduser())
    return str(repo_cache_dir(job) / "snapshots" / str(job.commit))


def repo_cache_dir(job: FetchJob) -> Path:
    """``<hf_home>/hub/models--org--name``."""
    return hub_cache_dir(job.hf_home) / repo_folder(job.repo)


def is_present(job: FetchJob, name: str) -> bool:
    """The file is complete on this host: right size and, in the cache, stored under its sha256.

    Files are hashed when fetched, not on every run (a 70B model is 40 GB of
    reading); a cache blob is named after the content's sha256, so a snapshot
    entry pointing at another blob is treated as missing.
    """
    path = Path(model_dir(job)) / name
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if not path.is_file():
        return False
    expected = job.sizes.get(name)
    if expected is not None and size != expected:
        return False
    sha = job.sha256.get(name)
    if sha and not job.local_dir and path.is_symlink() and Path(os.readlink(path)).name != sha:  # noqa: SIM103
        return False  # one refusal per test, as above
    return True


def _size(job: FetchJob, name: str) -> int:
    if name in job.sizes:
        return job.sizes[name]
    path = Path(model_dir(job)) / name
    return path.stat().st_size if path.exists() else 0


def _fetch_one(job: FetchJob, name: str, on_bytes: OnBytes | None) -> None:
    """Download one file with bounded retries and backoff; a corrupt file is never kept."""
    from mlxpipe.hub.faults import network_fault

    last: BaseException | None = None
    started = time.monotonic()
    attempts = 0
    while attempts < ATTEMPTS:
        if attempts:
            pause = BACKOFF_SECONDS[min(attempts, len(BACKOFF_SECONDS)) - 1]
            if time.monotonic() - started + pause > RETRY_WINDOW_SECONDS:
                break  # a hub this slow to fail is down: say so now rather than in a minute
            time.sleep(pause)
        attempts += 1
        counted = [0]

        def count(n: int) -> None:  # called within this attempt, never after it
            counted[0] += n  # noqa: B023
            if on_bytes:
                on_bytes(n)

        try:
            path = _download(job, name, count, force=isinstance(last, _Corrupt))
            _verify(job, name, path)
            return
        except Exception as e:  # sorted below: retried, mapped, or re-raised
            if counted[0]:
                started = time.monotonic()  # data flowed: the hub is alive, the window starts again
                if on_bytes:
                    on_bytes(-counted[0])  # the progress bar gives back what this attempt did not keep
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                target = Path(model_dir(job)) / name
                raise DownloadError(
                    f"{job.host}: no space left on the device while writing {target}; the partial file was removed",
                    "free space on that host, or point its hf_home/model_dir at a larger disk, then run download again",
                ) from None
            if not isinstance(e, _Corrupt) and not _transient(e):
                from mlxpipe.hub.faults import hub_errors

                with hub_errors(job.repo, job.host):
                    raise
            last = e
    if isinstance(last, _Corrupt):
        raise DownloadError(
            f"{job.host}: {name} from {job.repo} did not match the hub's sha256 in {attempts} attempts; "
            "nothing was kept",
            "the hub or a proxy on the way is serving bad data; try again later",
        )
    tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    fault = network_fault(last, job.host) if last is not None else None
    if fault is not None:
        raise DownloadError(
            f"{job.host}: could not fetch {name} from {job.repo} in {tries}: {fault.problem}",
            f"{fault.hint}; then run download again (it resumes)",
        )
    raise DownloadError(
        f"{job.host}: could not fetch {name} from {job.repo} in {tries} ({_short(last)})",
        "check that host's network and HF_ENDPOINT, then run download again (it resumes)",
    )


def _download(job: FetchJob, name: str, on_bytes: OnBytes, *, force: bool) -> str:
    from mlxpipe.hub.client import download_file

    return download_file(
        job.repo, name, str(job.commit),
        cache_dir=None if job.local_dir else hub_cache_dir(job.hf_home),
        local_dir=Path(job.local_dir).expanduser() if job.local_dir else None,
        tqdm_class=_progress_class(on_bytes), force_download=force,
    )


def _transient(e: BaseException) -> bool:
    """Worth another attempt: the network, a 5xx, or a short read; not offline mode or a TLS failure."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from mlxpipe.hub.faults import network_fault

    fault = network_fault(e)
    if fault is not None:
        return fault.transient
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None) or 0
        return status >= 500 or status in (408, 429)
    if isinstance(e, LocalEntryNotFoundError):  # the metadata request could not reach the hub
        return True
    if type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
        return True
    # huggingface_hub's own check that the body had Content-Length bytes.
    return isinstance(e, (ConnectionError, TimeoutError)) or "Consistency check failed" in str(e)


def _short(e: BaseException | None) -> str:
    text = str(e).strip().splitlines() if e else []
    return text[0] if text else type(e).__name__


def _verify(job: FetchJob, name: str, path: str) -> None:
    """Check the file against the hub's sha256; remove it (and its cache blob) if it differs."""
    expected = job.sha256.get(name)
    if not expected:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() == expected:
        return
    real = Path(path).resolve()
    Path(path).unlink(missing_ok=True)
    real.unlink(missing_ok=True)
    if job.local_dir:  # huggingface_hub's record that this file is up to date
        Path(job.local_dir).expanduser().joinpath(".cache", "huggingface", "download", name + ".metadata").unlink(
            missing_ok=True
        )
    raise _Corrupt(name)


def _write_ref(job: FetchJob) -> None:
    """Record ``refs/<revision>`` so mlx-lm and ``hf`` find the snapshot by branch name offline."""
    if job.local_dir or not job.revision or job.revision == job.commit:
        return
    ref = repo_cache_dir(job) / "refs" / job.revision
    if ref.is_file() and ref.read_text().strip() == job.commit:
        return
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(ref, str(job.commit))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DownloadError(f"{job.host}: no space left on the device while writing {ref}") from None
        raise


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
            done: bool | None = super().update(n)
            return done

    return _Forward


# --- Entry point on a host ------------------------------------------------------------

_PROGRESS_INTERVAL = 0.2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxpipe.download.fetch")
    parser.add_argument("--job", required=True, help="base64 FetchJob")
    parser.add_argument("--check", action="store_true", help="only report which files are present")
    args = parser.parse_args(argv)
    try:
        job = FetchJob.decode(args.job)
    except MlxpipeError as e:
        wire.emit(FetchError(message=e.message, hint=e.hint))
        return 1
    if args.check:
        present, missing = check(job)
        wire.emit(Check(present=present, missing=missing))
        return 0
    pending = [0.0, 0]  # last emit time, bytes not yet reported

    def on_bytes(n: int) -> None:
        pending[1] += n
        now = time.monotonic()
        if now - pending[0] > _PROGRESS_INTERVAL:
            wire.emit(Fetching(bytes=int(pending[1])))
            pending[0], pending[1] = now, 0

    def on_file(name: str, status: str, size: int) -> None:
        if pending[1]:
            wire.emit(Fetching(bytes=int(pending[1])))
            pending[1] = 0
        wire.emit(FileDone(name=name, status=status, bytes=size))

    try:
        result = fetch(job, on_bytes, on_file)
    except MlxpipeError as e:
        wire.emit(FetchError(message=e.message, hint=e.hint))
        return 1
    except Exception as e:  # reported to the controller, then re-raised for the traceback
        wire.emit(FetchError(message=f"{job.host}: {type(e).__name__}: {e}"))
        raise
    wire.emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
