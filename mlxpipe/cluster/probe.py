"""The doctor's probe: what one host has (Python, packages, mlx, memory, disk, files, free ports).

This file's source runs on each host as ``python -c <source> <json args>`` and prints one
line, ``MLXPIPE-PROBE {json}``. It must not need mlxpipe (the host may lack it: that is what
the doctor reports), so only the standard library, and syntax that old Pythons parse, so a
wrong interpreter is reported, not a crash: no annotations, no f-strings. Its types are in
type comments, which the checker reads and every Python skips.
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys

if False:  # the checker's imports (typing.TYPE_CHECKING, without importing typing on old Pythons)
    from typing import Any, Callable, Dict, List, Optional  # noqa: F401

MARK = "MLXPIPE-PROBE "


def versions(packages):
    # type: (List[str]) -> Dict[str, Optional[str]]
    version = None  # type: Optional[Callable[[str], str]]
    try:
        from importlib.metadata import version
    except ImportError:
        pass
    found = {}  # type: Dict[str, Optional[str]]
    for name in packages:
        try:
            found[name] = version(name) if version else None
        except Exception:
            found[name] = None
    return found


def mlx_device(out):
    # type: (Dict[str, Any]) -> None
    try:
        import mlx.core as mx
        out["mlx_import"] = None
        out["device"] = str(mx.default_device())
    except Exception as e:
        out["mlx_import"] = "%s: %s" % (type(e).__name__, e)


def sysctl(name):
    # type: (str) -> Optional[int]
    try:
        return int(subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:
        return None


def memory(out):
    # type: (Dict[str, Any]) -> None
    if sys.platform == "darwin":
        out["memory_total"] = sysctl("hw.memsize")
        wired = sysctl("iogpu.wired_limit_mb")
        out["wired_limit"] = wired * 1024 * 1024 if wired else None
        return
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo") if ":" in line)
        out["memory_total"] = int(info["MemTotal"].split()[0]) * 1024
        out["memory_available"] = int(info["MemAvailable"].split()[0]) * 1024
    except Exception:
        out["memory_total"] = None


def nearest(path):
    # type: (str) -> str
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def disk(paths):
    # type: (List[str]) -> Dict[str, Optional[List[Any]]]
    free = {}  # type: Dict[str, Optional[List[Any]]]
    for path in paths:
        try:
            where = nearest(path)
            free[path] = [where, shutil.disk_usage(where).free]
        except OSError:
            free[path] = None
    return free


def present(files_by_dir):
    # type: (Dict[str, Dict[str, int]]) -> Dict[str, int]
    """Bytes of the listed files already on the host at their expected size, per directory."""
    found = {}
    for d, files in files_by_dir.items():
        base, n = os.path.expanduser(d), 0
        for name, size in files.items():
            try:
                if os.path.getsize(os.path.join(base, name)) == size:
                    n += size
            except OSError:
                pass
        found[d] = n
    return found


def ports(wanted):
    # type: (List[List[Any]]) -> List[List[Any]]
    """[ip, port, None] for a port this host can bind, else [ip, port, why not]."""
    result = []  # type: List[List[Any]]
    for ip, port in wanted:
        s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            result.append([ip, port, None])
        except OSError as e:
            result.append([ip, port, e.strerror or str(e)])
        finally:
            s.close()
    return result


def probe(args):
    # type: (Dict[str, Any]) -> Dict[str, Any]
    out = {"python": platform.python_version(), "executable": sys.executable,
           "system": platform.system(), "machine": platform.machine(),
           "versions": versions(args["packages"])}  # type: Dict[str, Any]
    mlx_device(out)
    memory(out)
    out["disk"] = disk(args["paths"])
    out["present"] = present(args["files"])
    out["ports"] = ports(args["ports"])
    return out


if __name__ == "__main__":
    print(MARK + json.dumps(probe(json.loads(sys.argv[1]))))
