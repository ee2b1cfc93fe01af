"""cluster/layout_checks.py: a tensor-parallel group over TCP is warned, and so is a layout predicted slower than
fewer hosts (with both figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fixtures.cluster_facts import facts_beside
from mlxpipe.cluster.hostfile import parse_hostfile
from mlxpipe.cluster.layout_checks import layout_checks, tp_link_checks

# --- a group over TCP -------------------------------------------------------------------------------------------


def hostfile(machines: list[str], backend: str = "ring") -> Any:
    data = {"backend": backend, "hosts": [{"ssh": m, "ips": [f"10.0.0.{i}"]} for i, m in enumerate(machines)]}
    return parse_hostfile(data, Path("h.json"))


@pytest.mark.parametrize(("machines", "backend", "statuses"), [
    (["a", "b", "c", "d"], "ring", ["warn", "warn"]),
    (["a", "b", "c", "d"], "mpi", ["warn", "warn"]),
    (["a", "b", "c", "d"], "jaccl", ["ok", "ok"]),
    (["a", "a", "b", "b"], "ring", ["ok", "ok"]),  # each group on one machine; the pipeline crosses the link
    (["127.0.0.1"] * 4, "ring", ["ok", "ok"]),
])
def test_doctor_warns_on_groups_over_tcp(machines: list[str], backend: str, statuses: list[str]) -> None:
    checks = tp_link_checks(hostfile(machines, backend), 2, backend)
    assert [(c.check, c.ranks, c.status) for c in checks] == [
        ("tp links", (0, 1), statuses[0]), ("tp links", (2, 3), statuses[1])]
    for c in checks:
        assert (c.fix is not None and "JACCL" in c.fix and "mlx.distributed_config" in c.fix) == (c.status == "warn")
    assert tp_link_checks(hostfile(machines, backend), 1, backend) == []


# --- the layout predicted slower than fewer hosts ----------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.layouts import build_qwen2

    return build_qwen2(tmp_path_factory.mktemp("doctor-layout") / "qwen2", 8)


@pytest.mark.parametrize(("latency", "status"), [(50e-6, "ok"), (50e-3, "warn")])
def test_a_layout_slower_than_fewer_hosts_is_warned_with_both_figures(wide_model: Path, tmp_path: Path,
                                                                       latency: float, status: str) -> None:
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target

    hostfile = tmp_path / "two.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    facts_beside(hostfile, latency)
    target = resolve_target(str(wide_model), None, hostfile, None, None, None, None, "pipeline")
    meta = load_model_metadata(target)
    (check,) = layout_checks(target, meta, plan_target(target, meta))
    assert (check.check, check.status, check.ranks) == ("layout", status, (0, 1))
    if status == "ok":
        assert check.detail.endswith("no layout on fewer of these hosts is predicted faster")
        return
    # 50 ms links: a pipeline token pays a hop and two collectives of 100 ms; one host pays none.
    assert check.detail.startswith("predicted slower than fewer hosts: pipeline balanced 4,4 on 2 hosts: ")
    assert "; 1 host on the first 1 (127.0.0.1): " in check.detail and "tok/s decode" in check.detail
    assert check.fix == ("run on 127.0.0.1 alone (a hostfile of it), or see `mlxpipe plan --layout auto` for a "
                         "faster layout of every host")


def test_no_layout_check_without_facts(wide_model: Path, tmp_path: Path) -> None:
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target

    hostfile = tmp_path / "two.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    target = resolve_target(str(wide_model), None, hostfile, None, None, None, None, "pipeline")
    meta = load_model_metadata(target)
    assert layout_checks(target, meta, plan_target(target, meta)) == []
