"""``--fleet`` beside ``serve``'s option groups: the per-model options refused, the shared ones kept (no rank
starts: every case here is refused, or checked without a command)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxpipe.cli import app
from mlxpipe.cli._groups import LaunchFlags, TargetFlags
from mlxpipe.cli.fleet import refuse_model_flags, ring_base
from mlxpipe.cli.serve import ServeFlags
from mlxpipe.cluster.hostfile import parse_hostfile
from mlxpipe.defaults import DEFAULT_PORT


def test_the_groups_as_given_by_default_name_no_per_model_option() -> None:
    refuse_model_flags(TargetFlags(), ServeFlags(), LaunchFlags())  # nothing refused (LaunchFlags.config is no flag)
    refuse_model_flags(TargetFlags(hostfile=Path("h.json"), workload="batch"),
                       ServeFlags(port=9000, max_concurrency=2, drain_seconds=5),
                       LaunchFlags(context=4096, num_draft_tokens=3, ring_port=40000))


@pytest.mark.parametrize(("args", "hint"), [
    (["--model", "x"], "hint: drop --model"),
    (["--tp", "2"], "hint: drop --tp and give the entries 'tp'"),
    (["--served-model-name", "coder"], "hint: drop --served-model-name and give the entries 'names'"),
    (["--draft-model", "d"], "hint: drop --draft-model and give the entries 'draft-model'"),
    (["--adapter-path", "a"], "hint: drop --adapter-path and give the entries 'adapter-path'"),
    (["--split", "1,1"], "hint: drop --split"),
])
def test_serve_fleet_refuses_a_per_model_flag_before_reading_the_file(args: list[str], hint: str,
                                                                     tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--fleet", str(tmp_path / "missing.yaml"), *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {args[0]} is per model: with --fleet it goes in the fleet file, under each entry", hint]


def test_the_rings_start_at_ring_port_else_a_free_port_when_local_else_mlx_launchs() -> None:
    remote = [parse_hostfile([{"ssh": f"mini-{i}", "ips": [f"10.0.0.{i}"]}], Path("c.json")) for i in range(2)]
    local = [parse_hostfile([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2, Path("l.json")) for _ in range(2)]
    assert ring_base(remote, 6000) == ring_base(local, 6000) == 6000
    assert ring_base(remote, None) == DEFAULT_PORT
    assert 1024 < ring_base(local, None) < 65000 - 4  # room for the 4 ports of both pipelines
