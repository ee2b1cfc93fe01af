"""What one Mac is, asked over ssh in one round trip: chip, memory, macOS, disk, network, Thunderbolt, RDMA, Pythons.

The survey is a POSIX shell script, not Python: a fresh Mac has no Python worth the name (``/usr/bin/python3``
is a stub until the Command Line Tools are installed, and then 3.9), and finding one is part of what the
survey is for. It runs macOS's own tools and prints each one's output raw, in sections; this machine reads
them (``cluster/macos.py``), so the parsing is tested here, not on the Mac. Each Python it finds is asked
for its version and its mlx, mlx-lm and mlxpipe with a few lines of the standard library.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxpipe.cluster import macos, remote
from mlxpipe.cluster.macos import Interface, ThunderboltBus
from mlxpipe.errors import SetupError
from mlxpipe.host import Host

CONNECT_TIMEOUT = 5
SURVEY_TIMEOUT = 60.0  # system_profiler takes seconds on a real Mac
PACKAGES = ("mlx", "mlx-lm", "mlxpipe")
VENV = ".mlxpipe/venv"  # mlxpipe's own environment on each host, under its HOME (cluster install makes it)
_MARK = "@@mlxpipe "

# Runs under each Python the survey finds; old Pythons must parse it (no f-strings, no annotations).
_PYTHON_PROBE = """
import json, sys, sysconfig
try:
    from importlib.metadata import version
except ImportError:
    version = None
def v(name):
    try:
        return version(name) if version else None
    except Exception:
        return None
print(json.dumps({"executable": sys.executable, "version": "%d.%d.%d" % tuple(sys.version_info[:3]),
                  "venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix), "platform": sysconfig.get_platform(),
                  "packages": dict((n, v(n)) for n in PACKAGES)}))
""".replace("PACKAGES", repr(list(PACKAGES)))

# Non-interactive ssh on macOS gets PATH=/usr/bin:/bin:/usr/sbin:/sbin: Homebrew's Pythons are added
# (after whatever the host's own PATH has first).
SCRIPT = f"""
PATH="$PATH:/usr/sbin:/sbin:/usr/bin:/bin:/opt/homebrew/bin:/usr/local/bin"; export PATH
section() {{ n=$1; shift; o=$("$@" 2>/dev/null); r=$?; printf '{_MARK}%s %s\\n%s\\n' "$n" "$r" "$o"; }}
section hostname hostname
section home printf '%s' "$HOME"
section hf_home printf '%s' "${{HF_HOME:-}}"
section sysctl sysctl -n machdep.cpu.brand_string hw.memsize
section sw_vers sw_vers
section meminfo cat /proc/meminfo
section df df -Pk "$HOME"
section ports networksetup -listallhardwareports
section ifconfig ifconfig
section thunderbolt system_profiler SPThunderboltDataType -json
section ibv_devices ibv_devices
section sudo sudo -n true
for p in "$HOME/{VENV}/bin/python" python3 python3.13 python3.12 python3.11 python3.10 \\
         /opt/homebrew/bin/python3 /usr/local/bin/python3; do
  command -v "$p" >/dev/null 2>&1 && section python "$p" -c {shlex.quote(_PYTHON_PROBE)}
done
"""


@dataclass(frozen=True)
class Python:
    """One interpreter on a host, and mlxpipe's packages in it (None: not installed)."""

    path: str
    version: str
    packages: dict[str, str | None]
    venv: bool = False
    platform: str = ""  # sysconfig.get_platform(): "macosx-14.0-arm64", "linux-x86_64"

    @property
    def minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)


@dataclass(frozen=True)
class Machine:
    """What one host said about itself (None or empty: the tool is missing, as off macOS)."""

    ssh: str
    hostname: str
    home: str
    hf_home: str | None = None  # the host's own HF_HOME, when its environment sets one
    chip: str | None = None
    memory_bytes: int | None = None
    macos: str | None = None
    disk_free: int | None = None
    interfaces: tuple[Interface, ...] = ()
    thunderbolt: tuple[ThunderboltBus, ...] = ()
    thunderbolt_devices: dict[str, str] = field(default_factory=dict)  # receptacle -> en2
    rdma: tuple[str, ...] | None = None  # None: no ibv_devices (macOS before 26.2)
    sudo: bool = False  # passwordless sudo (mlx.distributed_config's --auto-setup needs it)
    pythons: tuple[Python, ...] = ()

    @property
    def venv_python(self) -> str:
        """Where ``mlxpipe cluster install`` keeps this host's interpreter."""
        return f"{self.home.rstrip('/')}/{VENV}/bin/python"

    def python(self, path: str) -> Python | None:
        return next((p for p in self.pythons if p.path == path), None)


def survey(host: Host, timeout: float = SURVEY_TIMEOUT, connect_timeout: int = CONNECT_TIMEOUT) -> Machine:
    """Ask ``host`` what it is; ``SetupError`` naming the host and the fix when ssh fails."""
    argv = remote.host_argv(host, ["sh", "-s"])
    if not host.is_local:
        argv[1:1] = ["-o", f"ConnectTimeout={connect_timeout}"]  # ssh keeps the first value given
    try:
        proc = subprocess.run(argv, input=SCRIPT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{host.ssh}: no answer within {timeout:.0f} s",
                         f"check that {host.ssh} is on and that `ssh {host.ssh} true` returns") from None
    if proc.returncode == 255 or _MARK not in proc.stdout:
        from mlxpipe.cluster.doctor import ssh_fix

        reason = _last_line(proc.stderr) or f"ssh exited with status {proc.returncode}"
        raise SetupError(f"{host.ssh}: cannot connect over ssh: {reason}", ssh_fix(host.ssh, reason))
    return read_survey(host.ssh, proc.stdout)


def read_survey(ssh: str, text: str) -> Machine:
    """The survey's printed sections -> a ``Machine``."""
    sections = _sections(text)

    def out(name: str) -> str:
        found = sections.get(name)
        return found[0][1] if found and found[0][0] == 0 else ""

    chip, memory = macos.parse_sysctl_chip(out("sysctl"))
    memory = memory or _meminfo(out("meminfo"))  # Linux hosts: mlxpipe runs there too (MLX on the CPU)
    ports = macos.parse_hardware_ports(out("ports"))
    ibv = sections.get("ibv_devices")
    pythons = _pythons([body for rc, body in sections.get("python", []) if rc == 0])
    return Machine(
        ssh=ssh, hostname=out("hostname").strip() or ssh, home=out("home").strip(),
        hf_home=out("hf_home").strip() or None, chip=chip, memory_bytes=memory,
        macos=macos.parse_sw_vers(out("sw_vers")), disk_free=macos.parse_df(out("df")),
        interfaces=macos.parse_ifconfig(out("ifconfig"), ports),
        thunderbolt=macos.parse_thunderbolt(out("thunderbolt")),
        thunderbolt_devices=macos.thunderbolt_devices(ports),
        # 127: the shell found no ibv_devices at all; any other status is a tool that ran.
        rdma=None if ibv is None or ibv[0][0] == 127 else macos.parse_ibv_devices(ibv[0][1]),
        sudo=bool(sections.get("sudo")) and sections["sudo"][0][0] == 0,
        pythons=pythons,
    )


def probe_python(host: Host, path: str) -> Python | None:
    """One interpreter's version and packages (None: it does not run)."""
    argv = remote.host_argv(host, [path, "-c", _PYTHON_PROBE])
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SURVEY_TIMEOUT)
    found = _pythons([proc.stdout]) if proc.returncode == 0 else ()
    return found[0] if found else None


def _meminfo(text: str) -> int | None:
    """``/proc/meminfo``'s MemTotal in bytes."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def _sections(text: str) -> dict[str, list[tuple[int, str]]]:
    """``{name: [(status, output), ...]}`` in the order printed (``python`` repeats)."""
    found: dict[str, list[tuple[int, str]]] = {}
    name, rc, body = None, 0, []  # type: ignore[var-annotated]
    for line in [*text.splitlines(), f"{_MARK}end 0"]:
        if line.startswith(_MARK):
            if name is not None:
                found.setdefault(name, []).append((rc, "\n".join(body)))
            fields = line[len(_MARK):].split()
            name, rc, body = fields[0], int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 1, []
        elif name is not None:
            body.append(line)
    return found


def _pythons(outputs: Sequence[str]) -> tuple[Python, ...]:
    """Each interpreter once (``python3`` and ``python3.11`` are often the same one)."""
    found: dict[str, Python] = {}
    for text in outputs:
        try:
            data = json.loads(text.strip().splitlines()[-1])
            python = Python(data["executable"], data["version"], dict(data["packages"]), bool(data.get("venv")),
                            str(data.get("platform", "")))
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        found.setdefault(python.path, python)
    return tuple(found.values())


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
