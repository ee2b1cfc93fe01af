"""cluster/probe.py: the doctor's probe, run as it runs on each host (``python -c <its source> <json>``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlxpipe.cluster.probe as probe_module

SOURCE = Path(probe_module.__file__).read_text()


def run_probe(args: dict[str, Any], python: str = sys.executable) -> dict[str, Any]:
    proc = subprocess.run([python, "-c", SOURCE, json.dumps(args)], capture_output=True, text=True, timeout=60,
                          cwd="/")  # not beside mlxpipe: the probe needs nothing of it
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith(probe_module.MARK)
    return json.loads(line[len(probe_module.MARK):])


def test_the_probe_reports_this_host(tmp_path: Path) -> None:
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # 2 bytes: as expected
    (model / "model.safetensors").write_text("partial")  # 7 bytes of 100: not there yet
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        report = run_probe({
            "packages": ["mlx", "no-such-package-here"],
            "paths": [str(tmp_path / "models" / "not-yet" / "deeper")],
            "files": {str(model): {"config.json": 2, "model.safetensors": 100, "tokenizer.json": 5}},
            "ports": [["127.0.0.1", taken]],
        })
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["versions"]["mlx"] and report["versions"]["no-such-package-here"] is None
    assert report["mlx_import"] is None and report["device"]
    assert report["memory_total"] > 0
    (where, free), = report["disk"].values()
    assert where == str(tmp_path / "models") and free > 0  # the nearest directory that exists
    assert report["present"] == {str(model): 2}
    ((ip, port, why),) = report["ports"]
    assert (ip, port) == ("127.0.0.1", taken) and why  # in use: says why


def test_an_interpreter_without_mlx_is_reported_not_a_crash(tmp_path: Path) -> None:
    # -I: isolated from this environment's site-packages, as a host's bare python would be.
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", SOURCE, json.dumps(
        {"packages": ["mlx"], "paths": [], "files": {}, "ports": []})], capture_output=True, text=True, timeout=60,
        cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip()[len(probe_module.MARK):])
    assert report["mlx_import"].startswith(("ModuleNotFoundError", "ImportError"))
    assert report["versions"] == {"mlx": None}
