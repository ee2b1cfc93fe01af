"""Running mlxpipe's own helpers on a host, and sending it files: locally, or over ssh.

Every value that comes from a hostfile reaches the remote shell through
``shlex.quote``; ssh runs in BatchMode so a missing key fails instead of
prompting, with ``--`` before the host. Secrets never go on a command line
(ssh arguments show in the process list): each host uses its own Hugging Face
login.
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxpipe.errors import DownloadError
from mlxpipe.host import Host

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR")
REMOTE_PYTHON = "python3"
PARTIAL_SUFFIX = ".mlxpipe-partial"
_ERROR_TAIL = 3


def python_for(host: Host) -> str:
    """The interpreter to run on ``host``."""
    if host.python:
        return host.python
    return sys.executable if host.is_local else REMOTE_PYTHON


def ssh_argv(host: Host, command: str) -> list[str]:
    """``ssh`` running the shell ``command`` (already quoted) on ``host``."""
    # "--" stops ssh reading a host name that starts with "-" as an option.
    return ["ssh", *SSH_OPTIONS, "--", host.ssh, command]


def host_argv(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The argument list that runs ``argv`` (with ``env``) on ``host``."""
    if host.is_local:
        return list(argv)
    assignments = [f"{k}={v}" for k, v in (env or {}).items()]
    return ssh_argv(host, shlex.join(["env", *assignments, *argv]) if assignments else shlex.join(argv))


def start(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``argv`` on ``host`` with stdout piped as text lines."""
    local_env = {**os.environ, **(env or {})} if host.is_local else None
    return subprocess.Popen(
        host_argv(host, argv, env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=local_env,
        start_new_session=True,
    )


# --- Sending files (download --from-controller) -----------------------------------------


@dataclass(frozen=True)
class Shipment:
    """Files to recreate on a host: paths relative to ``src_root`` here and ``dest_root`` there.

    ``files`` are sent with their content (a symlink here sends what it points
    at); ``links`` are symlinks recreated as they are, ``(path, target)``, after
    the files (the Hugging Face cache's snapshot entries pointing at blobs).
    """

    src_root: str
    dest_root: str  # on the host; may start with "~/"
    files: tuple[str, ...]
    links: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.files and not self.links


OnSent = Callable[[str, int], None]  # (relative path, bytes) after each file


def send(host: Host, shipment: Shipment, label: str, on_sent: OnSent | None = None) -> str:
    """Recreate ``shipment`` on ``host``; returns how: ``copy``, ``rsync`` or ``scp``."""
    if shipment.empty:
        return "none"
    if host.is_local:
        copy_local(shipment, label, on_sent)
        return "copy"
    _check_plain(shipment, label)
    # One round trip makes the directories and says whether the host has rsync too.
    remote_rsync = _run(host, label, ssh_argv(host, _mkdir_command(shipment) + " && { command -v rsync || true; }"))
    if shutil.which("rsync") and remote_rsync.strip():
        _run(host, label, rsync_argv(host, shipment))
        if on_sent:
            for rel in shipment.files:
                on_sent(rel, _src_size(shipment, rel))
        return "rsync"
    for rel in shipment.files:
        _run(host, label, scp_argv(host, shipment, rel))
        if on_sent:
            on_sent(rel, _src_size(shipment, rel))
    _run(host, label, ssh_argv(host, _finish_command(shipment)))
    return "scp"


def copy_local(shipment: Shipment, label: str, on_sent: OnSent | None = None) -> None:
    """Copy into a directory of this machine; each file appears under its name only once complete."""
    dest = Path(shipment.dest_root).expanduser()
    src = Path(shipment.src_root)
    for rel in shipment.files:
        target = dest / rel
        tmp = target.with_name(target.name + PARTIAL_SUFFIX)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp)
            os.replace(tmp, target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise DownloadError(
                    f"{label}: no space left on the device while writing {target}; the partial file was removed",
                    "free space on that host, or point its hf_home/model_dir at a larger disk",
                ) from None
            raise DownloadError(f"{label}: cannot write {target} ({e.strerror or e})") from None
        if on_sent:
            on_sent(rel, target.stat().st_size)
    for rel, link_target in shipment.links:
        link = dest / rel
        tmp = link.with_name(link.name + PARTIAL_SUFFIX)
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        os.symlink(link_target, tmp)
        os.replace(tmp, link)


def rsync_argv(host: Host, shipment: Shipment) -> list[str]:
    """``rsync -a --relative`` of exactly the shipment's paths (links stay links)."""
    user, _, name = host.ssh.rpartition("@")
    # rsync appends the host (and "-l user") to -e itself; putting the user in -e
    # keeps "--" right before the host name.
    ssh = shlex.join(["ssh", *SSH_OPTIONS, *(["-l", user] if user else []), "--"])
    paths = [*shipment.files, *(rel for rel, _ in shipment.links)]
    sources = [f"{shipment.src_root.rstrip('/')}/./{rel}" for rel in paths]
    return ["rsync", "-a", "--relative", "--copy-unsafe-links", "-e", ssh, "--", *sources,
            f"{name}:{_remote_path(shipment.dest_root)}/"]


def scp_argv(host: Host, shipment: Shipment, rel: str) -> list[str]:
    """``scp`` of one file to a temporary name beside its place (moved in by the finish step)."""
    dest = f"{_remote_path(shipment.dest_root)}/{rel}{PARTIAL_SUFFIX}"
    return ["scp", "-q", *SSH_OPTIONS, "--", f"{shipment.src_root.rstrip('/')}/{rel}", f"{host.ssh}:{dest}"]


def _mkdir_command(shipment: Shipment) -> str:
    root = _remote_path(shipment.dest_root)
    dirs = {root} | {f"{root}/{d}" for d in _parents(shipment)}
    return shlex.join(["mkdir", "-p", "--", *sorted(dirs)])


def _finish_command(shipment: Shipment) -> str:
    """Move scp's temporary files into place, then create the links."""
    root = _remote_path(shipment.dest_root)
    steps = [shlex.join(["mv", "-f", "--", f"{root}/{rel}{PARTIAL_SUFFIX}", f"{root}/{rel}"]) for rel in shipment.files]
    steps += [shlex.join(["ln", "-sfn", "--", target, f"{root}/{rel}"]) for rel, target in shipment.links]
    return " && ".join(steps) or "true"


def _parents(shipment: Shipment) -> set[str]:
    paths = [*shipment.files, *(rel for rel, _ in shipment.links)]
    return {str(Path(p).parent) for p in paths if "/" in p}


def _remote_path(path: str) -> str:
    """A path for ssh, scp and rsync: ``~/x`` becomes ``x``, which all three take relative to home."""
    if path in ("~", "~/"):
        return "."
    return path[2:] if path.startswith("~/") else path.rstrip("/") or "/"


def _check_plain(shipment: Shipment, label: str) -> None:
    """Refuse remote paths that some scp/rsync versions would hand to a shell unquoted.

    Older rsync and scp pass the remote path through the remote shell; newer
    ones do not, so no single quoting is right for both. Paths made only of
    characters that need no quoting (``shlex.quote(p) == p``) are right for all.
    """
    paths = [_remote_path(shipment.dest_root), *shipment.files]
    paths += [p for link in shipment.links for p in link]
    for p in paths:
        if shlex.quote(p) != p:
            raise DownloadError(
                f"{label}: cannot send to {p!r} over ssh safely (spaces or shell characters in the path)",
                "use an hf_home/model_dir path of letters, digits and ./_-+@%=:, for that host",
            )


def _src_size(shipment: Shipment, rel: str) -> int:
    try:
        return (Path(shipment.src_root) / rel).stat().st_size
    except OSError:
        return 0


def _run(host: Host, label: str, argv: list[str]) -> str:
    """Run ``argv`` here; its stdout, or a ``DownloadError`` naming the host."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as e:
        raise DownloadError(f"{label}: cannot run {argv[0]} ({e.strerror or e})") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-_ERROR_TAIL:]) or "no output"
        hint = (
            f"check that `ssh {host.ssh}` works without a password (mlxpipe doctor)"
            if proc.returncode == 255
            else "check the disk space and permissions on that host"
        )
        raise DownloadError(f"{label}: {argv[0]} failed with status {proc.returncode} ({tail})", hint)
    return proc.stdout
