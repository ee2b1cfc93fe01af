"""``mlxpipe plan --fleet`` through Typer's runner: every entry's plan, and the hosts shared by entries checked
against both (tiny checkpoints, read as metadata: no rank starts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.cli import app
from mlxpipe.host import GB
from mlxpipe.hub.client import load_metadata
from mlxpipe.plan.costs import RUNTIME_OVERHEAD


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fleet")
    return make_tiny_checkpoint("llama", root / "big"), make_tiny_checkpoint("qwen2", root / "small")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def write(tmp_path: Path, models: tuple[Path, Path], budget: float) -> tuple[Path, Path]:
    """Three local hosts of ``budget`` bytes each; big on hosts 0 and 1, small on host 1."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "memory_gb": 8,
                                     "wired_limit_gb": budget / GB}] * 3))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - model: {models[0]}\n    hosts: [0, 1]\n    names: [big]\n"
                     f"  - model: {models[1]}\n    hosts: [1]\n    names: [small]\n")
    return fleet, hostfile


def weights(model: Path) -> int:
    return sum(t.nbytes for t in load_metadata(str(model)).tensors)


def test_plan_fleet_shows_each_entry_and_fits_when_the_shared_host_holds_both(models: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    fleet, hostfile = write(tmp_path, models, 4 * RUNTIME_OVERHEAD)
    result = invoke("plan", "--fleet", str(fleet), "--hostfile", str(hostfile), "--context", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] is True and data["shortfalls"] == []
    assert [(p["names"][-1], p["hosts"], [r["rank"] for r in p["plan"]["ranks"]]) for p in data["pipelines"]] == [
        ("big", [0, 1], [0, 1]), ("small", [1], [0])]


def test_plan_fleet_refuses_a_shared_host_that_cannot_hold_both_in_one_line(models: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    # Room for one runtime and either model whole, never for two runtimes.
    budget = RUNTIME_OVERHEAD + max(weights(models[0]), weights(models[1])) + 2**20
    fleet, hostfile = write(tmp_path, models, budget)
    result = invoke("plan", "--fleet", str(fleet), "--hostfile", str(hostfile), "--context", "16")
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: host 1 (127.0.0.1) lacks "), result.stderr
    assert "to hold big and small together" in lines[0]
    assert "small: entry 1, replica 0 of 1, on hosts 1 (127.0.0.1)" in result.stdout


@pytest.mark.parametrize("flag", [["--model", "x"], ["--tp", "2"], ["--layout", "auto"]])
def test_a_per_model_flag_beside_fleet_is_a_usage_error(models: tuple[Path, Path], tmp_path: Path,
                                                        flag: list[str]) -> None:
    fleet, hostfile = write(tmp_path, models, 4 * RUNTIME_OVERHEAD)
    result = invoke("plan", "--fleet", str(fleet), "--hostfile", str(hostfile), *flag)
    assert result.exit_code == 2
    assert f"error: {flag[0]} is per model: with --fleet it goes in the fleet file" in result.stderr
