"""``mlxpipe download``: every host gets exactly the files its ranks need.

The controller groups ranks by host and storage location (two ranks sharing a
machine and a cache fetch each file once), starts ``mlxpipe.download.fetch`` on each
host (locally or over ssh) in parallel, and folds their progress events into
one report per host.

``--from-controller`` serves hosts without internet: each host first reports
which of its files it already holds (``mlxpipe.download.fetch --check``), the
controller fetches the files some host lacks once, into its own cache, and
sends every host only its missing files, in the same layout (``remote.send``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mlxpipe.cluster import remote, storage
from mlxpipe.download.fetch import FetchJob
from mlxpipe.errors import DownloadError, MlxpipeError, UsageError
from mlxpipe.host import LOCAL_HOST, Host
from mlxpipe.hub.cache import hub_cache_dir, repo_folder
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol import wire
from mlxpipe.protocol.fetch_events import FETCH_EVENTS, Check, FetchError, Fetching, FetchResult, FileDone
from mlxpipe.protocol.message import Event

_STDERR_TAIL = 20
CONTROLLER_LABEL = "controller (this machine)"


@dataclass(frozen=True)
class HostTask:
    """One host's share: the union of its ranks' files, in one storage location."""

    host: Host
    ranks: tuple[int, ...]  # empty for the controller's own cache
    job: FetchJob

    @property
    def label(self) -> str:
        return self.job.host

    @property
    def total_bytes(self) -> int:
        return self.job.total_bytes


@dataclass
class HostReport:
    """What happened on one host (filled in as events arrive)."""

    task: HostTask
    done_bytes: int = 0  # moved during this run so far
    present_bytes: int = 0  # found already there
    result: FetchResult | None = None
    error: str | None = None
    hint: str | None = None
    via: str = "hub"  # hub, or how --from-controller sent the files: copy, rsync, scp, none
    missing: tuple[str, ...] = ()
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL))
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)

    @property
    def todo_bytes(self) -> int:
        """What this run has to move to the host."""
        return max(self.task.total_bytes - self.present_bytes, 0)


@dataclass(frozen=True)
class Distribution:
    """The outcome of ``--from-controller``: the controller's own fetch, then each host."""

    controller: HostReport | None
    reports: list[HostReport]


OnUpdate = Callable[[HostReport], None]


def require_hub(meta: ModelMetadata) -> None:
    """Hosts fetch from the hub; a local directory reaches them only from the controller."""
    if meta.local or not meta.commit:
        raise UsageError(
            f"{meta.source} is a local directory: there is nothing to download from the hub",
            "send it to the hosts with `mlxpipe download --from-controller`",
        )


def host_tasks(
    plan: Plan, meta: ModelMetadata, hosts: Sequence[Host], ranks: Sequence[int] | None = None, *, here: bool = False
) -> list[HostTask]:
    """Group the plan's ranks by (host, storage) and list each group's files.

    ``here``: the files go to this machine (``download --rank R``), into the
    storage the hostfile names for that rank, else this machine's default.
    """
    wanted = set(range(len(hosts))) if ranks is None else set(ranks)
    groups: dict[tuple[str, str], list[int]] = {}
    chosen: dict[tuple[str, str], Host] = {}
    for rp in plan.ranks:
        if rp.rank in wanted:
            host = _on_this_machine(hosts[rp.rank]) if here else hosts[rp.rank]
            key = (host.ssh, storage.model_path(host, meta))
            groups.setdefault(key, []).append(rp.rank)
            chosen.setdefault(key, host)
    tasks = []
    for key, group in groups.items():
        host = chosen[key]
        name = "this machine" if here and not hosts[group[0]].is_local else host.ssh
        tasks.append(HostTask(host, tuple(group), _job(plan, meta, host, group, label(name, group))))
    return tasks


def whole_model_tasks(meta: ModelMetadata, hosts: Sequence[Host]) -> list[HostTask]:
    """Every file of ``meta`` to every host, once per (host, storage): a model each rank loads whole
    (the draft model of speculative decoding)."""
    files = set(meta.support_files) | {t.file for t in meta.tensors}
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault((host.ssh, storage.model_path(host, meta)), []).append(rank)
    tasks = []
    for (ssh, _), ranks in groups.items():
        host = hosts[ranks[0]]
        local_dir = storage.local_dir(host, meta)
        job = _fetch_job(meta, files, label(ssh, ranks), hf_home=None if local_dir else storage.hf_home(host),
                         local_dir=local_dir)
        tasks.append(HostTask(host, tuple(ranks), job))
    return tasks


def label(name: str, ranks: Sequence[int]) -> str:
    """``studio-2 (rank 1)``, ``127.0.0.1 (ranks 0,1)``: how messages name a host."""
    return f"{name} (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})"


def _on_this_machine(host: Host) -> Host:
    return dataclasses.replace(host, ssh=LOCAL_HOST)


def _job(plan: Plan, meta: ModelMetadata, host: Host, ranks: Sequence[int], name: str) -> FetchJob:
    files = set(plan.support_files)
    for r in ranks:
        files.update(plan.ranks[r].files)
    local_dir = storage.local_dir(host, meta)
    return _fetch_job(meta, files, name, hf_home=None if local_dir else storage.hf_home(host), local_dir=local_dir)


def _fetch_job(meta: ModelMetadata, files: set[str] | Sequence[str], name: str, *, hf_home: str | None,
               local_dir: str | None) -> FetchJob:
    from mlxpipe.hub.cache import offline

    # JSON files first: small, and a repo the host cannot read fails before any weight moves.
    ordered = tuple(sorted(files, key=lambda f: (not f.endswith(".json"), f)))
    return FetchJob(
        repo=meta.source, commit=meta.commit, revision=meta.revision, files=ordered,
        sizes={f: meta.file_sizes[f] for f in ordered if f in meta.file_sizes},
        sha256={f: meta.file_sha256[f] for f in ordered if f in meta.file_sha256},
        hf_home=hf_home, local_dir=local_dir, host=name, offline=offline(),
    )


# --- Each host fetches from the hub -------------------------------------------------------


def run_local(task: HostTask, on_update: OnUpdate | None = None) -> HostReport:
    """Fetch ``task`` in this process (``--rank R`` / ``--local``, and the controller's cache)."""
    from mlxpipe.download.fetch import fetch

    report = HostReport(task)

    def on_bytes(n: int) -> None:
        report.done_bytes += n
        if on_update:
            on_update(report)

    def on_file(name: str, status: str, size: int) -> None:
        if status == "present":
            report.present_bytes += size
            if on_update:
                on_update(report)

    report.result = fetch(task.job, on_bytes, on_file)
    report.done_bytes = report.result.fetched_bytes
    if on_update:
        on_update(report)
    return report


def run_on_hosts(tasks: Sequence[HostTask], on_update: OnUpdate | None = None) -> list[HostReport]:
    """Run every task on its host in parallel; raise naming the first host that failed."""
    for task in tasks:
        if not task.job.commit:
            raise UsageError(f"{task.job.repo} is a local directory: hosts cannot fetch it from the hub")
    reports = [HostReport(t) for t in tasks]
    _parallel(reports, lambda r, lock: _fetch_on_host(r, lock, on_update))
    _raise_first_failure(reports)
    return reports


def _fetch_on_host(report: HostReport, lock: threading.Lock, on_update: OnUpdate | None) -> None:
    def on_event(event: Event) -> None:
        with lock:
            _apply(report, event)
            if on_update:
                on_update(report)

    _run_helper(report, [], on_event)
    if report.result is None and report.error is None:
        report.error = f"{report.task.label}: the fetch ended without a result"


def _run_helper(report: HostReport, extra: list[str], on_event: Callable[[Event], None]) -> None:
    """Run ``python -m mlxpipe.download.fetch`` for the task on its host, feeding its events to ``on_event``."""
    task = report.task
    argv = [remote.python_for(task.host), "-m", "mlxpipe.download.fetch", *extra, "--job", task.job.encode()]
    try:
        proc = report.proc = remote.start(task.host, argv)
    except OSError as e:
        report.error = f"{task.label}: cannot start {argv[0]} ({e.strerror or e})"
        return
    assert proc.stdout is not None and proc.stderr is not None
    drain = threading.Thread(target=_drain, args=(proc.stderr, report.stderr), daemon=True)
    drain.start()
    for line in proc.stdout:
        data = wire.parse_event(line)
        if data is not None:
            on_event(FETCH_EVENTS.from_wire(data))
    code = proc.wait()
    drain.join()
    if code != 0 and report.error is None:
        tail = " | ".join(list(report.stderr)[-3:]) or "no output"
        report.error = f"{task.label}: mlxpipe.download.fetch exited with status {code} ({tail})"
        if code == 255 and not task.host.is_local:
            report.hint = f"check that `ssh {task.host.ssh}` works without a password (mlxpipe doctor)"
        elif code == 127 or "No module named" in tail:
            report.hint = f"install mlxpipe on {task.host.ssh}, or set 'python' for it in the hostfile"


def _apply(report: HostReport, event: Event) -> None:
    if isinstance(event, Fetching):
        report.done_bytes += event.bytes
    elif isinstance(event, FileDone) and event.status == "present":
        report.present_bytes += event.bytes
    elif isinstance(event, FetchResult):
        report.result = event
        report.done_bytes = event.fetched_bytes
    elif isinstance(event, Check):
        report.missing = tuple(event.missing)
        report.present_bytes = sum(report.task.job.sizes.get(f, 0) for f in event.present)
    elif isinstance(event, FetchError):
        report.error, report.hint = event.message, event.hint


def _drain(stream: IO[str], sink: deque[str]) -> None:
    for line in stream:
        line = line.rstrip()
        if line:
            sink.append(line)


def _parallel(reports: Sequence[HostReport], work: Callable[[HostReport, threading.Lock], None]) -> None:
    lock = threading.Lock()

    def guarded(report: HostReport) -> None:
        try:
            work(report, lock)
        except MlxpipeError as e:
            report.error, report.hint = e.message, e.hint

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in reports]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        # The host processes run in sessions of their own (no terminal signal reaches
        # them): end them here, or a Ctrl-C would leave them downloading.
        for r in reports:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        raise


def _raise_first_failure(reports: Sequence[HostReport]) -> None:
    failed = [r for r in reports if r.error]
    if failed:
        first = failed[0]
        more = len(failed) - 1
        others = f" ({more} more host{'s' if more > 1 else ''} failed)" if more else ""
        raise DownloadError(f"{first.error}{others}", first.hint)


# --- --from-controller: fetch once here, send each host its own files ----------------------


def distribute(tasks: Sequence[HostTask], meta: ModelMetadata, on_update: OnUpdate | None = None) -> Distribution:
    """Fetch what some host lacks once into the controller's cache, then send each host its files."""
    reports = [HostReport(t) for t in tasks]
    _parallel(reports, lambda r, lock: _check_host(r))
    _raise_first_failure(reports)
    missing = sorted({f for r in reports for f in r.missing})
    controller = None
    if missing and not meta.local:
        job = _fetch_job(meta, missing, CONTROLLER_LABEL, hf_home=None, local_dir=None)
        controller = run_local(HostTask(Host(rank=-1, ssh=LOCAL_HOST), (), job), on_update)
    if on_update:
        for r in reports:
            on_update(r)
    _parallel(reports, lambda r, lock: _send_to_host(r, meta, lock, on_update))
    _raise_first_failure(reports)
    return Distribution(controller, reports)


def _check_host(report: HostReport) -> None:
    events: list[Event] = []
    _run_helper(report, ["--check"], events.append)
    for event in events:
        _apply(report, event)
    if report.error is None and not any(isinstance(e, Check) for e in events):
        report.error = f"{report.task.label}: mlxpipe.download.fetch --check ended without an answer"


def _send_to_host(report: HostReport, meta: ModelMetadata, lock: threading.Lock, on_update: OnUpdate | None) -> None:
    task = report.task
    missing = set(report.missing)
    shipment = shipment_for(task, meta, report.missing)

    def on_sent(rel: str, size: int) -> None:
        with lock:
            report.done_bytes += size
            if on_update:
                on_update(report)

    report.via = remote.send(task.host, shipment, task.label, on_sent)
    fetched = tuple(f for f in task.job.files if f in missing)
    present = tuple(f for f in task.job.files if f not in missing)
    sizes = task.job.sizes
    report.result = FetchResult(
        host=task.label, path=storage.model_path(task.host, meta),
        fetched_bytes=sum(sizes.get(f, 0) for f in fetched), present_bytes=sum(sizes.get(f, 0) for f in present),
        fetched_files=fetched, present_files=present,
    )
    report.done_bytes = report.result.fetched_bytes
    if on_update:
        with lock:
            on_update(report)


def shipment_for(task: HostTask, meta: ModelMetadata, missing: Sequence[str]) -> remote.Shipment:
    """What the controller sends ``task``'s host: its missing files, in that host's layout.

    Into a Hugging Face cache: the blobs, the snapshot symlinks and the ref, as
    huggingface_hub lays them out. Into a plain directory (``model_dir``, or a
    local model): the content under each file name.
    """
    job = task.job
    if meta.local:
        return remote.Shipment(meta.source, str(job.local_dir), tuple(missing))
    hub = hub_cache_dir(None)
    repo_dir = repo_folder(meta.source)
    snapshot = f"{repo_dir}/snapshots/{meta.commit}"
    if job.local_dir:
        return remote.Shipment(str(hub / snapshot), job.local_dir, tuple(missing))
    files: list[str] = []
    links: list[tuple[str, str]] = []
    for name in missing:
        entry = f"{snapshot}/{name}"
        blob = _blob_of(hub, entry)
        if blob is None:  # a cache without symlinks: the content sits in the snapshot
            files.append(entry)
        else:
            files.append(blob)
            links.append((entry, os.readlink(hub / entry)))
    ref = f"{repo_dir}/refs/{meta.revision}"
    if missing and meta.revision and meta.revision != meta.commit and (hub / ref).is_file():
        files.append(ref)
    return remote.Shipment(str(hub), f"{str(job.hf_home).rstrip('/')}/hub", tuple(dict.fromkeys(files)), tuple(links))


def _blob_of(hub: Path, entry: str) -> str | None:
    """The cache-relative blob a snapshot entry links to, or None if it is not such a link."""
    path = hub / entry
    if not path.is_symlink():
        return None
    target = os.path.normpath(os.path.join(os.path.dirname(entry), os.readlink(path)))
    repo_dir = entry.split("/", 1)[0]
    return target if target.startswith(f"{repo_dir}/blobs/") and (hub / target).is_file() else None


# --- JSON for scripts ----------------------------------------------------------------------


def tasks_json(meta: ModelMetadata, tasks: Sequence[HostTask]) -> dict[str, Any]:
    """``download --dry-run --json``: each host's files and bytes."""
    return {
        "model": meta.source, "commit": meta.commit, "model_bytes": sum(meta.file_sizes.values()),
        "hosts": [
            {"host": t.host.ssh, "ranks": list(t.ranks), "files": list(t.job.files), "bytes": t.total_bytes}
            for t in tasks
        ],
    }


def reports_json(
    meta: ModelMetadata, reports: Sequence[HostReport], controller: HostReport | None = None
) -> dict[str, Any]:
    """``download --json``: what each host holds, and what this run moved to it."""
    def entry(r: HostReport) -> dict[str, Any]:
        res = r.result
        assert res is not None
        return {
            "host": r.task.host.ssh, "ranks": list(r.task.ranks), "path": res.path, "via": r.via,
            "fetched_bytes": res.fetched_bytes, "present_bytes": res.present_bytes,
            "fetched_files": list(res.fetched_files), "files": list(r.task.job.files),
        }

    hosts = [entry(r) for r in reports if r.result]
    return {
        "model": meta.source, "commit": meta.commit, "model_bytes": sum(meta.file_sizes.values()),
        "fetched_bytes": sum(h["fetched_bytes"] for h in hosts),
        "controller": entry(controller) if controller is not None and controller.result else None,
        "hosts": hosts,
    }
