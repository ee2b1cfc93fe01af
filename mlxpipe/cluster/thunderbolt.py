"""Thunderbolt between the hosts: the cables each survey shows, and MLX's own ``mlx.distributed_config`` for the rest.

``cables`` matches each host's Thunderbolt buses to the Macs plugged into them by domain UUID, as
``mlx.distributed_config`` does, to decide whether the hosts are cabled at all and to say which
cables are missing. The wiring itself (which IP on which port, the ring's order, the JACCL devices,
``ifconfig`` on each Mac) is MLX's: ``wire`` runs its public command and reads the hostfile it
writes. Where it cannot configure a Mac itself (no passwordless sudo), it prints the commands to
run there; ``wire`` keeps them per host, for the user to run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxpipe.cluster.survey import Machine
from mlxpipe.errors import SetupError

CONFIG_TIMEOUT = 300.0  # it sshes to every host several times, one after another
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROMPT = b"Enter to continue"


@dataclass(frozen=True)
class Cable:
    """A Thunderbolt cable between hosts ``a`` and ``b`` (indices), with each end's network device."""

    a: int
    b: int
    a_device: str | None
    b_device: str | None
    generation: int | None  # 5: Thunderbolt 5 (RDMA-capable), 4: 40 Gb/s


@dataclass(frozen=True)
class Wiring:
    """What ``mlx.distributed_config`` made: its hostfile's hosts, in its order, and the set-up left to do."""

    backend: str  # ring (TCP over Thunderbolt), jaccl (RDMA mesh) or jaccl-ring
    hosts: tuple[dict[str, Any], ...]  # {"ssh", "ips", "rdma"} per host, rank order
    envs: tuple[str, ...] = ()
    setup: dict[str, str] = field(default_factory=dict)  # host -> the commands it printed for it, not run


def cables(machines: Sequence[Machine]) -> list[Cable]:
    """Every cable between two of ``machines``, once each (a pair may have several)."""
    ends = {}  # domain UUID -> (host index, bus)
    for i, m in enumerate(machines):
        for bus in m.thunderbolt:
            ends[bus.domain] = (i, bus)
    found = []
    for i, m in enumerate(machines):
        for bus in m.thunderbolt:
            if bus.peer_domain not in ends:
                continue
            j, other = ends[bus.peer_domain]
            if j <= i:  # seen from the other end already (or a loop back into the same Mac)
                continue
            found.append(Cable(i, j, m.thunderbolt_devices.get(bus.receptacle),
                               machines[j].thunderbolt_devices.get(other.receptacle),
                               bus.generation or other.generation))
    return found


def uncabled(machines: Sequence[Machine], found: Sequence[Cable]) -> list[int]:
    """The hosts no cable joins to another host."""
    joined = {c.a for c in found} | {c.b for c in found}
    return [i for i in range(len(machines)) if i not in joined]


def config_command() -> str:
    """``mlx.distributed_config`` beside this interpreter (the mlx that runs mlxpipe), else on PATH."""
    beside = Path(sys.executable).parent / "mlx.distributed_config"
    found = str(beside) if beside.exists() else shutil.which("mlx.distributed_config")
    if not found:
        raise SetupError("mlx.distributed_config is not installed on this machine (it comes with mlx)",
                         "pip install mlx in the environment that runs mlxpipe")
    return found


def wire(hosts: Sequence[str], auto_setup: bool, timeout: float = CONFIG_TIMEOUT) -> Wiring:
    """Run ``mlx.distributed_config --over thunderbolt`` for ``hosts``; its hostfile and the set-up it left.

    With ``auto_setup`` (every host has passwordless sudo) it configures each Mac's Thunderbolt ports
    itself. Without, it prints each host's commands and waits for Enter after each: it gets its Enters,
    and the commands are kept for the user to run.
    """
    with tempfile.TemporaryDirectory(prefix="mlxpipe-wiring-") as tmp:
        out = Path(tmp) / "hostfile.json"
        argv = [config_command(), "--hosts", ",".join(hosts), "--over", "thunderbolt", "--output-hostfile", str(out)]
        if auto_setup:
            argv.append("--auto-setup")
        returncode, stdout, stderr = _run_answering(argv, timeout)
        if returncode != 0 or not out.exists():
            said = _errors(stderr) or _last(stdout)
            raise SetupError(f"mlx.distributed_config failed (exit status {returncode}): {said}",
                             f"run it by hand to see why: {' '.join(['mlx.distributed_config', *argv[1:5]])} --verbose")
        data = json.loads(out.read_text())
    return Wiring(
        backend=data.get("backend") or "ring",
        hosts=tuple({"ssh": h["ssh"], "ips": list(h.get("ips") or []), "rdma": list(h.get("rdma") or [])}
                    for h in data["hosts"]),
        envs=tuple(data.get("envs") or ()),
        setup=dict(parse_setup(stdout)),
    )


def _run_answering(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv``, pressing Enter each time it asks ("Enter to continue").

    The Enter is written only once asked: the ssh commands it runs before share its stdin, and would
    swallow any written ahead.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()

    def read_out() -> None:
        answered = 0
        while chunk := os.read(proc.stdout.fileno(), 4096):  # type: ignore[union-attr]
            out.extend(chunk)
            while out.count(_PROMPT) > answered:
                answered += 1
                try:
                    proc.stdin.write(b"\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                except OSError:
                    return

    def read_err() -> None:
        err.extend(proc.stderr.read())  # type: ignore[union-attr]

    readers = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SetupError(f"mlx.distributed_config did not finish within {timeout:.0f} s",
                         f"run it by hand to see where it stops: {' '.join(argv[:5])}") from None
    finally:
        for t in readers:
            t.join(5)
        proc.stdin.close()
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def parse_setup(stdout: str) -> list[tuple[str, str]]:
    """The commands ``mlx.distributed_config`` printed per host (``Setup for HOST`` / ``====`` / commands)."""
    found = []
    lines = _ANSI.sub("", stdout).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Setup for ") and i + 1 < len(lines) and set(lines[i + 1].strip()) == {"="}:
            commands = []
            for follow in lines[i + 2:]:
                if not follow.strip() or follow.startswith(("Setup for ", "Enter to continue")):
                    break
                commands.append(follow.strip())
            found.append((line[len("Setup for "):].strip(), " ; ".join(commands)))
    return found


def _errors(stderr: str) -> str:
    """Its [ERROR] lines (else a traceback's last line), in one line."""
    lines = [_ANSI.sub("", line).strip() for line in stderr.splitlines()]
    errors = [line.replace("[ERROR]", "").strip() for line in lines if line.startswith("[ERROR]")]
    errors = [line for line in errors if line]
    return "; ".join(errors[:4]) or _last(stderr)


def _last(text: str) -> str:
    lines = [_ANSI.sub("", line).strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
