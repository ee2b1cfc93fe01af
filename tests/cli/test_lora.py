"""``mlxpipe lora``: flags refused before any rank starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fixtures.cli import MLXPIPE, REPO


def test_bad_flags_are_refused_before_any_rank_starts(workdir: Path) -> None:
    cases = [
        (["--micro-batches", "3"], "--batch-size 4 is not a multiple of --micro-batches 3"),
        (["--schedule", "pipedream"], "--schedule 'pipedream': use one of gpipe, 1f1b"),
        (["--resume-adapter-file", str(workdir / "nope.safetensors")], "no such file"),
    ]
    for extra, message in cases:
        result = subprocess.run(
            [MLXPIPE, "lora", "--train", "--model", str(workdir / "llama"), "--data", str(workdir / "text"), *extra],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr
