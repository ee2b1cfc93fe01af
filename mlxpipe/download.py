"""``mlxpipe download``: every host fetches exactly the files its ranks need.

The controller groups ranks by host and storage location (two ranks on one
machine share one cache and fetch each file once), starts ``mlxpipe.fetch`` on
each host (locally or over ssh) in parallel, and folds their progress events
into one report per host.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mlxpipe import protocol, remote, storage
from mlxpipe.errors import DownloadError, UsageError
from mlxpipe.fetch import FetchJob, FetchResult
from mlxpipe.hostfile import Host
from mlxpipe.metadata import ModelMetadata
from mlxpipe.plan import Plan

_STDERR_TAIL = 20


@dataclass(frozen=True)
class HostTask:
    """One host's share of the download: the union of its ranks' files."""

    host: Host
    ranks: tuple[int, ...]
    job: FetchJob

    @property
    def total_bytes(self) -> int:
        return sum(self.job.sizes.get(f, 0) for f in self.job.files)


@dataclass
class HostReport:
    """What happened on one host (filled in as events arrive)."""

    task: HostTask
    done_bytes: int = 0
    result: FetchResult | None = None
    error: str | None = None
    hint: str | None = None
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL))


OnUpdate = Callable[[HostReport], None]


def host_tasks(plan: Plan, meta: ModelMetadata, hosts: Sequence[Host], ranks: Sequence[int] | None = None) -> list[HostTask]:
    """Group the plan's ranks by (host, storage) and list each group's files."""
    if meta.local or not meta.commit:
        raise UsageError(
            f"{meta.source} is a local directory: there is nothing to download from the hub",
            "local models reach remote hosts with `mlxpipe download --from-controller`",
        )
    wanted = set(range(len(hosts))) if ranks is None else set(ranks)
    groups: dict[tuple[str, str], list[int]] = {}
    for rp in plan.ranks:
        if rp.rank in wanted:
            host = hosts[rp.rank]
            groups.setdefault((host.ssh, storage.model_path(host, meta)), []).append(rp.rank)
    tasks = []
    for (_, _), group in groups.items():
        host = hosts[group[0]]
        files = set(plan.support_files)
        for r in group:
            files.update(plan.ranks[r].files)
        ordered = tuple(sorted(files, key=lambda f: (not f.endswith(".json"), f)))
        job = FetchJob(
            repo=meta.source, commit=meta.commit, files=ordered,
            sizes={f: meta.file_sizes.get(f, 0) for f in ordered},
            sha256={f: meta.file_sha256[f] for f in ordered if f in meta.file_sha256},
            hf_home=None if storage.local_dir(host, meta) else storage.hf_home(host),
            local_dir=storage.local_dir(host, meta), host=host.ssh,
        )
        tasks.append(HostTask(host, tuple(group), job))
    return tasks


def run_local(task: HostTask, on_update: OnUpdate | None = None) -> HostReport:
    """Fetch ``task`` in this process (``--rank R`` / ``--local``)."""
    from mlxpipe.fetch import fetch

    report = HostReport(task)

    def on_bytes(n: int) -> None:
        report.done_bytes += n
        if on_update:
            on_update(report)

    report.result = fetch(task.job, on_bytes)
    report.done_bytes = task.total_bytes
    if on_update:
        on_update(report)
    return report


def run_on_hosts(tasks: Sequence[HostTask], on_update: OnUpdate | None = None) -> list[HostReport]:
    """Run every task on its host in parallel; raise naming the first host that failed."""
    reports = [HostReport(t) for t in tasks]
    lock = threading.Lock()
    threads = [
        threading.Thread(target=_run_one, args=(r, lock, on_update), daemon=True) for r in reports
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in reports if r.error]
    if failed:
        first = failed[0]
        others = f" ({len(failed) - 1} more hosts failed)" if len(failed) > 1 else ""
        raise DownloadError(f"{first.task.host.ssh}: {first.error}{others}", first.hint)
    return reports


def _run_one(report: HostReport, lock: threading.Lock, on_update: OnUpdate | None) -> None:
    task = report.task
    argv = [remote.python_for(task.host), "-m", "mlxpipe.fetch", "--job", task.job.encode()]
    try:
        proc = remote.start(task.host, argv)
    except OSError as e:
        report.error = f"cannot start the fetch ({e})"
        return
    stderr_thread = threading.Thread(target=_drain, args=(proc.stderr, report.stderr), daemon=True)
    stderr_thread.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        event = protocol.parse_event(line)
        if event is None:
            continue
        with lock:
            _apply(report, event)
            if on_update:
                on_update(report)
    code = proc.wait()
    stderr_thread.join()
    if report.result is None and report.error is None:
        tail = " | ".join(list(report.stderr)[-3:]) or "no output"
        report.error = f"the fetch exited with status {code} ({tail})"
        if code == 255 and not task.host.is_local:
            report.hint = f"check that `ssh {task.host.ssh}` works without a password (mlxpipe doctor)"
        elif code == 127 or "No module named" in tail:
            report.hint = f"install mlxpipe on {task.host.ssh}, or set 'python' for it in the hostfile"


def _apply(report: HostReport, event: dict) -> None:
    kind = event.get("event")
    if kind == "progress":
        report.done_bytes += int(event.get("bytes", 0))
    elif kind == "file" and event.get("status") == "present":
        report.done_bytes += int(event.get("bytes", 0))
    elif kind == "done":
        fields = {k: event[k] for k in FetchResult.__dataclass_fields__}
        fields["fetched_files"] = tuple(fields["fetched_files"])
        fields["present_files"] = tuple(fields["present_files"])
        report.result = FetchResult(**fields)
        report.done_bytes = report.task.total_bytes
    elif kind == "error":
        report.error = str(event.get("message"))
        report.hint = event.get("hint")


def _drain(stream, sink: deque[str]) -> None:
    for line in stream:
        line = line.rstrip()
        if line:
            sink.append(line)
