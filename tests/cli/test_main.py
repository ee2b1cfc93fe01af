"""``mlxpipe.cli.main``: the exit status of the command, and a process that leaves without Python's teardown only
when nothing is left running that Python's exit would wait for (``cli.leave``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_main(tmp_path: Path, *lines: str) -> subprocess.CompletedProcess[str]:
    """``lines`` then ``mlxpipe.cli.main()``, in a fresh interpreter."""
    script = "\n".join(["import sys, threading, time", *lines, "from mlxpipe.cli import main", "main()"])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)


def test_the_commands_exit_status_and_its_output_reach_the_caller(tmp_path: Path) -> None:
    done = run_main(tmp_path, f"sys.argv = ['mlxpipe', 'plan', '--model', {str(tmp_path / 'nothing')!r}]")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ")
    version = run_main(tmp_path, "sys.argv = ['mlxpipe', '--version']")
    assert version.returncode == 0
    assert version.stdout.startswith("mlxpipe ")


def test_a_thread_still_working_is_waited_for(tmp_path: Path) -> None:
    """A thread that is not a daemon finishes its work before the process exits, as with Python's own exit."""
    out = tmp_path / "written"
    done = run_main(
        tmp_path,
        f"threading.Thread(target=lambda: (time.sleep(0.5), open({str(out)!r}, 'w').write('done'))).start()",
        "sys.argv = ['mlxpipe', '--version']",
    )
    assert done.returncode == 0
    assert out.read_text() == "done"
