"""launch/ranks.py without ranks: mlx.launch's own lines about a rank's end."""

from __future__ import annotations

import json

import pytest

from mlxpipe.launch.ranks import NODE_EXIT


@pytest.mark.parametrize(("line", "rank", "code"), [
    ("Node with rank 1 exited with code -9", "1", "-9"),
    ("\x1b[33mNode with rank 0 exited with code 3\x1b[0m", "0", "3"),
    ("Node with rank 2 was killed", "2", None),
    ("Node with rank 1 completed", "1", None),
])
def test_mlx_launchs_lines_about_a_ranks_end_are_recognised(line: str, rank: str, code: str | None) -> None:
    match = NODE_EXIT.search(line)
    assert match is not None and (match.group(1), match.group(2)) == (rank, code)
    assert NODE_EXIT.search(json.dumps({"event": "log"})) is None
