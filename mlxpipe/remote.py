"""Running mlxpipe's own helpers on a host: locally, or over ssh.

Every value that comes from a hostfile reaches the remote shell through
``shlex.quote``; ssh runs in BatchMode so a missing key fails instead of
prompting. Secrets never go on a command line (ssh arguments show in the
process list): each host uses its own Hugging Face login.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Mapping, Sequence

from mlxpipe.hostfile import Host

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR")
REMOTE_PYTHON = "python3"


def python_for(host: Host) -> str:
    """The interpreter to run on ``host``."""
    if host.python:
        return host.python
    return sys.executable if host.is_local else REMOTE_PYTHON


def host_argv(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The argument list that runs ``argv`` (with ``env``) on ``host``."""
    if host.is_local:
        return list(argv)
    assignments = [f"{k}={v}" for k, v in (env or {}).items()]
    remote = shlex.join(["env", *assignments, *argv]) if assignments else shlex.join(argv)
    # "--" stops ssh reading a host name that starts with "-" as an option.
    return ["ssh", *SSH_OPTIONS, "--", host.ssh, remote]


def start(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``argv`` on ``host`` with stdout piped as text lines."""
    import os

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
