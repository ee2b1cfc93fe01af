"""``mlxpipe cluster install``: every host gets the controller's mlxpipe, mlx and mlx-lm, in a venv mlxpipe owns.

Per host, over ssh: survey it (``survey.py``); when its ``~/.mlxpipe/venv`` already has the
controller's three versions, nothing changes. Else make the venv (with the host's Python of the
controller's minor version, else its newest 3.10+), copy mlxpipe's own wheel over (``wheels.own``:
built from the source tree where mlxpipe is installed editable, as .ci/check-install builds the wheel it
proves; else packed from this install) and install the pinned versions:

* with ``--wheelhouse DIR``: from those wheels only, never a registry;
* else from the host's package registry (its own pip configuration), and where that fails (no
  network, a firewall) from the controller's wheels: this machine's own installed packages when the
  host is the same platform and Python, else ``pip download`` for the host's platform here.

Wheels travel with ``cluster/remote.py``'s rsync/scp helpers. The offline install reads no pip
configuration on the host (``PIP_CONFIG_FILE=/dev/null``): its index and constraints must not change
what the controller sent. Afterwards the venv's versions are read back; the hostfile's ``python`` keys
are pointed at the venvs (atomically) by ``point_hostfile``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxpipe.cluster import remote, wheels
from mlxpipe.cluster.survey import PACKAGES, VENV, Machine, Python, probe_python, survey
from mlxpipe.errors import SetupError
from mlxpipe.host import Host

MIN_PYTHON = (3, 10)
WHEELS_DIR = ".mlxpipe/wheels"  # under the host's HOME: the wheels of the last install from the controller
REGISTRY_TIMEOUT = 15  # seconds pip waits on the host's registry before the controller's wheels are used
PIP_TIMEOUT = 1800.0
UNCHANGED, INSTALLED, FAILED, SKIPPED = "unchanged", "installed", "failed", "skipped"

Progress = Callable[[str, str], None]  # (host, what is happening)


@dataclass(frozen=True)
class ControllerEnv:
    """The controller's Python, packages and platform, which every host's venv is made to match."""

    python: tuple[int, int]
    versions: dict[str, str]  # mlxpipe, mlx, mlx-lm
    platform: str  # sysconfig.get_platform()

    @classmethod
    def here(cls) -> ControllerEnv:
        from importlib.metadata import PackageNotFoundError, version

        found = {}
        for name in PACKAGES:
            try:
                found[name] = version(name)
            except PackageNotFoundError:
                raise SetupError(f"{name} is not installed on this machine, so there is no version to give the hosts",
                                 f"pip install {name} here first") from None
        return cls((sys.version_info.major, sys.version_info.minor), found, sysconfig.get_platform())

    def pins(self) -> list[str]:
        return [f"{name}=={v}" for name, v in self.versions.items()]

    def describe(self) -> str:
        return ", ".join(f"{name} {v}" for name, v in self.versions.items())


@dataclass(frozen=True)
class Installed:
    """One host's outcome."""

    host: str
    status: str  # unchanged, installed, failed, skipped
    detail: str
    python: str | None = None  # the venv's interpreter, once it has the controller's versions
    fix: str | None = None
    source: str | None = None  # where the wheels came from

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "detail": self.detail, "python": self.python,
                "fix": self.fix, "source": self.source}


class Wheels:
    """The controller's wheels, made once and shared by every host's install (thread-safe)."""

    def __init__(self, env: ControllerEnv, wheelhouse: Path | None, work: Path) -> None:
        self.env, self.wheelhouse, self.work = env, wheelhouse, work
        self._lock = threading.RLock()  # download() packs mlxpipe's wheel while holding it
        self._made: dict[str, Path] = {}
        self._pip: tuple[Path | None] | None = None  # (pip's wheel or None), once looked for

    def mlxpipe(self) -> Path:
        """mlxpipe's own wheel at the controller's version: the wheelhouse's, else this install's (``wheels.own``)."""
        with self._lock:
            if "mlxpipe" not in self._made:
                version = self.env.versions["mlxpipe"]
                given = sorted(self.wheelhouse.glob(f"mlxpipe-{version}-*.whl")) if self.wheelhouse else []
                if given:
                    self._made["mlxpipe"] = given[0]
                else:
                    from importlib.metadata import distribution

                    self._made["mlxpipe"] = wheels.own(distribution("mlxpipe"), self.work / "mlxpipe")
            return self._made["mlxpipe"]

    def pip(self) -> Path | None:
        """pip's wheel, which runs the install on every host (``python pip.whl/pip install``, as pip supports for
        bootstrapping) and puts pip in the venv: the wheelhouse's, else packed from this machine's pip; None when
        neither has one (the venv's own pip then, from ensurepip)."""
        with self._lock:
            if self._pip is None:
                from importlib.metadata import PackageNotFoundError, distribution

                given = sorted(self.wheelhouse.glob("pip-*-py3-none-any.whl")) if self.wheelhouse else []
                try:
                    self._pip = (given[0] if given else wheels.pack(distribution("pip"), self.work / "pip"),)
                except PackageNotFoundError:
                    self._pip = (None,)
            return self._pip[0]

    def controller(self) -> Path:
        """A directory with the wheels of everything mlxpipe runs on here (this machine's installed packages;
        mlxpipe's own is ``mlxpipe()``)."""
        with self._lock:
            if "closure" not in self._made:
                out = self.work / "controller"
                out.mkdir(parents=True, exist_ok=True)
                for dist in wheels.closure(self.env.pins()):
                    if wheels.normalize(dist.metadata["Name"]) != "mlxpipe":
                        wheels.pack(dist, out)
                self._made["closure"] = out
            return self._made["closure"]

    def download(self, venv: Python, platforms: Sequence[str]) -> Path:
        """``pip download`` here of the pinned packages for another platform (a registry this machine reaches)."""
        key = f"{venv.platform}-{venv.minor}"
        with self._lock:
            if key not in self._made:
                out = self.work / f"download-{key}"
                major, minor = venv.minor
                argv = [sys.executable, "-m", "pip", "download", "-q", "--dest", str(out), "--only-binary=:all:",
                        "--python-version", f"{major}.{minor}", "--implementation", "cp"]
                for platform in platforms:
                    argv += ["--platform", platform]
                pins = self.env.pins()
                if venv.platform.startswith("macosx") and not self.env.platform.startswith("macosx"):
                    # pip evaluates markers for this machine, so mlx's Metal part (macOS only) is asked for by name.
                    pins.append(f"mlx-metal=={self.env.versions['mlx']}")
                others = [pin for pin in pins if not pin.startswith("mlxpipe==")]
                proc = subprocess.run([*argv, str(self.mlxpipe()), *others], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SetupError(f"pip download for {venv.platform} failed here: {_tail(proc.stderr)}",
                                     "pass --wheelhouse with wheels for the hosts' platform")
                self._made[key] = out
            return self._made[key]


def install(hosts: Sequence[Host], *, wheelhouse: Path | None = None, on_progress: Progress | None = None,
            env: ControllerEnv | None = None) -> list[Installed]:
    """Make each host's venv match the controller; one result per ssh destination, in the hostfile's order."""
    env = env or ControllerEnv.here()
    progress = on_progress or (lambda host, text: None)
    destinations = list(dict.fromkeys(h.ssh for h in hosts))
    by_ssh = {h.ssh: h for h in hosts}
    with tempfile.TemporaryDirectory(prefix="mlxpipe-install-") as work:
        made = Wheels(env, wheelhouse, Path(work))

        def one(ssh: str) -> Installed:
            host = by_ssh[ssh]
            if host.is_local:
                return Installed(ssh, SKIPPED, "this machine: its ranks run the controller's own environment")
            try:
                return _install_host(host, env, made, wheelhouse, lambda text: progress(ssh, text))
            except SetupError as e:
                return Installed(ssh, FAILED, e.message, fix=e.hint)

        with ThreadPoolExecutor(max_workers=min(8, len(destinations))) as pool:
            return list(pool.map(one, destinations))


def _install_host(host: Host, env: ControllerEnv, made: Wheels, wheelhouse: Path | None,
                  say: Callable[[str], None]) -> Installed:
    say("surveying")
    machine = survey(host)
    venv_path = machine.venv_python
    venv = machine.python(venv_path)
    if venv is not None and _matches(venv, env):
        return Installed(host.ssh, UNCHANGED, f"~/{VENV} already has {env.describe()}", venv_path)
    if venv is None:
        base = _base_python(machine, env)
        say(f"creating ~/{VENV} with Python {base.version}")
        # Without ensurepip, whose install of pip compiles every one of its modules (three quarters of the venv's
        # time); the pip that installs the packages runs from the controller's wheel and installs itself too.
        without_pip = ["--without-pip"] if made.pip() is not None else []
        _remote(host, ["sh", "-c", 'mkdir -p "$1" && shift && exec "$@"', "sh", str(Path(venv_path).parents[2]),
                       base.path, "-m", "venv", *without_pip, str(Path(venv_path).parents[1])], "making the venv")
        venv = probe_python(host, venv_path)
        if venv is None:
            raise SetupError(f"{host.ssh}: the new venv's {venv_path} does not run",
                             f"remove ~/{VENV} on {host.ssh} and run install again")
    source = _install_wheels(host, machine, venv, env, made, wheelhouse, say)
    after = probe_python(host, venv_path)
    if after is None or not _matches(after, env):
        have = ", ".join(f"{n} {(after.packages.get(n) if after else None) or '-'}" for n in PACKAGES)
        raise SetupError(f"{host.ssh}: after installing, {VENV} has {have}, not {env.describe()}",
                         f"look at pip's output: run {venv_path} -m pip install {' '.join(env.pins())} there")
    return Installed(host.ssh, INSTALLED, f"{env.describe()} in ~/{VENV}", venv_path, source=source)


def _matches(python: Python, env: ControllerEnv) -> bool:
    return all(python.packages.get(name) == version for name, version in env.versions.items())


def _base_python(machine: Machine, env: ControllerEnv) -> Python:
    """The host's interpreter to make the venv with: the controller's minor version, else the newest 3.10+."""
    usable = [p for p in machine.pythons if not p.venv and p.minor >= MIN_PYTHON]
    same = [p for p in usable if p.minor == env.python]
    if same or usable:
        return (same or sorted(usable, key=lambda p: p.minor, reverse=True))[0]
    major, minor = env.python
    raise SetupError(f"{machine.ssh}: no Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer (macOS's own python3 is 3.9)",
                     f"install Python {major}.{minor} on {machine.ssh} (python.org's installer, or Homebrew: "
                     f"brew install python@{major}.{minor}), then run install again")


def _install_wheels(host: Host, machine: Machine, venv: Python, env: ControllerEnv, made: Wheels,
                    wheelhouse: Path | None, say: Callable[[str], None]) -> str:
    """Install the pinned versions into the venv; returns where the wheels came from."""
    dest = f"{machine.home.rstrip('/')}/{WHEELS_DIR}"
    pip_wheel = made.pip()
    # pip from its wheel where the controller has one (it installs itself into the venv beside the packages), else
    # the venv's own. --no-compile, as uv installs by default: a module is compiled on its first import instead, and
    # most of transformers' thousands never are (compiling them all took three quarters of the install).
    shipped_pip = f"{dest}/{pip_wheel.name}" if pip_wheel else None
    runner = [f"{shipped_pip}/pip"] if shipped_pip else ["-m", "pip"]
    pip = [machine.venv_python, *runner, "install", "-q", "--disable-pip-version-check", "--no-input", "--no-compile"]
    ours = [made.mlxpipe()] if pip_wheel is None else [made.mlxpipe(), pip_wheel]
    pins = env.pins() if pip_wheel is None else [*env.pins(), f"pip=={_wheel_version(pip_wheel)}"]
    if wheelhouse is None:
        say("installing from the host's package registry")
        _ship(host, ours, dest)
        online = _pip(host, [*pip, "--retries", "0", "--timeout", str(REGISTRY_TIMEOUT), "--find-links", dest, *pins])
        if online.returncode == 0:
            return "registry"
        say(f"no registry ({_tail(online.stderr)}): using the controller's wheels")
        if _same_platform(venv, env):
            files = [*sorted(made.controller().glob("*.whl")), *ours]
        else:
            files = [*sorted(made.download(venv, _platforms(host, machine, shipped_pip)).glob("*.whl")), *ours]
        source = "the controller's wheels"
    else:
        files = [*sorted(wheelhouse.glob("*.whl")), *ours]
        source = f"the wheelhouse {wheelhouse}"
    files = list({f.name: f for f in files}.values())  # a wheelhouse's pip is also ours
    say(f"copying {len(files)} wheels to ~/{WHEELS_DIR}")
    _ship(host, files, dest)
    say(f"installing {env.describe()}")
    offline = _pip(host, [*pip, "--no-index", "--find-links", dest, *pins], isolated=True)
    if offline.returncode != 0:
        raise SetupError(f"{host.ssh}: pip install from {source} failed: {_tail(offline.stderr)}",
                         "give --wheelhouse the missing wheels (pip download them for the hosts' platform)")
    return source


def _same_platform(venv: Python, env: ControllerEnv) -> bool:
    """This machine's packed wheels install there: same OS and architecture, same Python minor."""
    def os_arch(platform: str) -> tuple[str, str]:
        parts = platform.split("-")
        return parts[0], parts[-1]

    return venv.minor == env.python and os_arch(venv.platform) == os_arch(env.platform)


def _platforms(host: Host, machine: Machine, pip_wheel: str | None) -> list[str]:
    """The platform tags the host's venv accepts (pip's own list), for ``pip download --platform``; ``pip_wheel``:
    pip's wheel on the host, where the venv has no pip of its own."""
    code = ("import json, sys; sys.path[:0] = sys.argv[1:]; from pip._vendor.packaging import tags; "
            "print(json.dumps(list(dict.fromkeys(t.platform for t in tags.sys_tags()))))")
    argv = [machine.venv_python, "-c", code, *([pip_wheel] if pip_wheel else [])]
    proc = subprocess.run(remote.host_argv(host, argv), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    try:
        return list(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise SetupError(f"{host.ssh}: cannot read the platform tags of {machine.venv_python}",
                         "pass --wheelhouse with wheels for that host") from None


def _wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (``pip-25.3-py3-none-any.whl``: 25.3)."""
    return wheel.name.split("-")[1]


def _ship(host: Host, files: Sequence[Path], dest: str) -> None:
    """The wheels into ``dest`` on the host, replacing what an earlier install left there."""
    _remote(host, ["sh", "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", dest], "emptying the wheel directory")
    with tempfile.TemporaryDirectory(prefix="mlxpipe-ship-") as staging:
        names = []
        for f in files:
            link = Path(staging) / f.name
            if not link.exists():
                link.symlink_to(f.resolve())  # rsync --copy-unsafe-links and scp send what it points at
                names.append(f.name)
        remote.send(host, remote.Shipment(staging, dest, tuple(names)), host.ssh)


def _pip(host: Host, argv: Sequence[str], isolated: bool = False) -> subprocess.CompletedProcess[str]:
    env = {"PIP_CONFIG_FILE": "/dev/null"} if isolated else None
    return subprocess.run(remote.host_argv(host, argv, env), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=PIP_TIMEOUT)


def _remote(host: Host, argv: Sequence[str], doing: str) -> None:
    proc = subprocess.run(remote.host_argv(host, argv), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"{host.ssh}: {doing} failed: {_tail(proc.stderr) or f'exit status {proc.returncode}'}",
                         f"check the disk space and permissions in the HOME of {host.ssh}")


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and "is ignored" not in line]
    return " | ".join(lines[-2:])


def point_hostfile(path: Path, results: Sequence[Installed]) -> list[str]:
    """Point each installed host's ``python`` at its venv, in ``path`` (JSON or YAML), replaced in one step.

    Returns the hosts whose key changed; the file is not touched when none did.
    """
    import yaml

    from mlxpipe.cluster.hostfile import parse_hostfile
    from mlxpipe.paths import replacing

    pythons = {r.host: r.python for r in results if r.python}
    is_yaml = path.suffix in (".yaml", ".yml")
    data = yaml.safe_load(path.read_text()) if is_yaml else json.loads(path.read_text())
    entries = data["hosts"] if isinstance(data, dict) else data
    changed = []
    for entry in entries:
        wanted = pythons.get(entry.get("ssh"))
        if wanted and entry.get("python") != wanted:
            entry["python"] = wanted
            changed.append(entry["ssh"])
    if not changed:
        return []
    parse_hostfile(data, path)
    with replacing(path) as tmp:
        tmp.write_text(yaml.safe_dump(data, sort_keys=False) if is_yaml else json.dumps(data, indent=2) + "\n")
    return list(dict.fromkeys(changed))
