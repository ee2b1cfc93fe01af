"""cluster/facts_file.py: where the facts live, and when they are used. The links job that measures them runs on real
ranks in tests/e2e/test_layout.py."""

from __future__ import annotations

import json
from pathlib import Path

from fixtures.cluster_facts import FACTS
from mlxpipe.cluster.facts_file import facts_path, load_facts, write_facts
from mlxpipe.cluster.hostfile import load_hostfile


def hostfile(tmp_path: Path, *ips: str, name: str = "cluster.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"hosts": [{"ssh": ssh, "ips": [ip]} for ssh, ip in zip("ab", ips, strict=True)]}))
    return path


def test_the_facts_live_beside_their_hostfile() -> None:
    assert facts_path(Path("/x/cluster.json")) == Path("/x/cluster.facts.json")
    assert facts_path(Path("ring.yaml")) == Path("ring.facts.json")


def test_facts_are_used_for_the_hosts_they_were_measured_on_only(tmp_path: Path) -> None:
    path = hostfile(tmp_path, "10.0.0.1", "10.0.0.2")
    assert load_facts(load_hostfile(path)) == (None, "no cluster.facts.json beside cluster.json: links not measured")
    write_facts(FACTS, path)
    assert load_facts(load_hostfile(path)) == (FACTS, None)
    moved = hostfile(tmp_path, "10.0.0.1", "10.0.0.9")
    assert load_facts(load_hostfile(moved)) == (
        None, f"{facts_path(moved)} is of other hosts than cluster.json lists now: measure again")
    facts_path(moved).write_text("{")
    assert load_facts(load_hostfile(moved))[1].startswith(f"{facts_path(moved)}: ")  # type: ignore[union-attr]
