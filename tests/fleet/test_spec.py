"""fleet/spec.py: the fleet file, checked against the hostfile; every mistake is one line naming the file, the
entry and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxpipe.cluster.hostfile import Hostfile, parse_hostfile
from mlxpipe.errors import FleetError
from mlxpipe.fleet.spec import load_fleet

HOSTS = parse_hostfile([{"ssh": f"mac-{i}", "ips": [f"10.0.0.{i}"], "memory_gb": 64} for i in range(4)]
                       + [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2, Path("cluster.json"))


def fleet_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_a_fleet_file_gives_each_entry_its_hosts_names_replicas_and_options(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, """
models:
  - model: org/big
    hosts: [mac-0, mac-1]
    names: [coder, claude-sonnet-4-5]
    tp: 2
    prompt-cache-gb: 1.5
  - model: org/small
    hosts: [2, 3]
    replicas: 2
    names: [small]
    draft-model: org/tiny
    layout: pipeline
""")
    fleet = load_fleet(path, HOSTS)
    big, small = fleet.entries
    assert (big.hosts, big.names, big.tp, big.prompt_cache_gb, big.replicas) == ((0, 1), ("coder", "claude-sonnet-4-5"),
                                                                                  2, 1.5, 1)
    assert (small.hosts, small.replicas, small.groups(), small.draft_model) == ((2, 3), 2, ((2,), (3,)), "org/tiny")
    assert fleet.names == ("org/big", "coder", "claude-sonnet-4-5", "org/small", "small")
    assert fleet.entry_for("claude-sonnet-4-5") is big and fleet.entry_for("org/small") is small
    assert fleet.entry_for("gpt-4") is None
    assert (big.label, small.label) == ("coder", "small")


def test_a_replica_is_a_hostfile_of_its_own_hosts_ranked_from_zero(tmp_path: Path) -> None:
    fleet = load_fleet(fleet_file(tmp_path, "models: [{model: m, hosts: [mac-3, 1, mac-2, 0], replicas: 2}]"), HOSTS)
    entry = fleet.entries[0]
    second = fleet.replica_hostfile(entry, 1)
    assert [(h.rank, h.ssh) for h in second.hosts] == [(0, "mac-2"), (1, "mac-0")]
    assert isinstance(second, Hostfile) and second.path == HOSTS.path and second.hosts[0].memory_gb == 64


@pytest.mark.parametrize(("text", "line"), [
    ("models: [{hosts: [0]}]", "fleet.yaml: entry 0: no 'model'"),
    ("models: [{model: m}]", "fleet.yaml: entry 0 (m): no 'hosts'"),
    ("models: [{model: m, hosts: [0], size: 2}]", "fleet.yaml: entry 0 (m): unknown key 'size'"),
    ("models: [{model: m, hosts: [0], draft_model: d}]", "fleet.yaml: entry 0 (m): unknown key 'draft_model'"),
    ("models: [{model: m, hosts: [studio-9]}]", "fleet.yaml: entry 0 (m): 'hosts': cluster.json has no host "
                                                "'studio-9'"),
    ("models: [{model: m, hosts: [7]}]", "fleet.yaml: entry 0 (m): 'hosts': cluster.json has no host 7"),
    ("models: [{model: m, hosts: [mac-1, 1]}]", "fleet.yaml: entry 0 (m): 'hosts' lists host 1 (mac-1) twice"),
    ("models: [{model: m, hosts: [127.0.0.1]}]", "fleet.yaml: entry 0 (m): 'hosts': '127.0.0.1' is 2 hosts of "
                                                 "cluster.json (4, 5)"),
    ("models: [{model: m, hosts: [0, 1, 2], replicas: 2}]", "fleet.yaml: entry 0 (m): 'replicas' 2: its 3 hosts do "
                                                            "not split into 2 equal groups"),
    ("models: [{model: m, hosts: [0, 1], replicas: 0}]", "fleet.yaml: entry 0 (m): 'replicas' must be a whole number "
                                                         "of at least 1, got 0"),
    ("models: [{model: m, hosts: [0, 1, 2], tp: 2}]", "fleet.yaml: entry 0 (m): 'tp' 2: each replica's 3 hosts do "
                                                      "not split into groups of 2"),
    ("models: [{model: m, hosts: [0], layout: fast}]", "fleet.yaml: entry 0 (m): 'layout' 'fast': use one of auto, "
                                                       "pipeline"),
    ("models: [{model: m, hosts: [0], prompt-cache-gb: -1}]", "fleet.yaml: entry 0 (m): 'prompt-cache-gb' must be a "
                                                              "number of at least 0, got -1"),
    ("models: [{model: a, hosts: [0], names: [x]}, {model: b, hosts: [1], names: [x]}]",
     "fleet.yaml: entry 1 (b): 'names': 'x' is entry 0's name too"),
    ("models: [{model: a, hosts: [0]}, {model: a, hosts: [1]}]", "fleet.yaml: entry 1 (a): 'model': 'a' is entry 0's "
                                                                 "name too"),
    ("models: [{model: a, hosts: [0], names: [b]}, {model: b, hosts: [1]}]",
     "fleet.yaml: entry 1 (b): 'model': 'b' is entry 0's name too"),
    ("models: []", "fleet.yaml: 'models' must be a non-empty list of entries"),
    ("model: m", "fleet.yaml: expected a mapping with a 'models' list"),
    ("models: [{model: m, hosts: [0]}]\nport: 9", "fleet.yaml: unknown top-level key 'port'"),
    ("models: [{model: m, hosts: [0]", "fleet.yaml: not valid YAML (while parsing a flow mapping)"),
    ("models: [7]", "fleet.yaml: entry 0: expected a mapping with 'model' and 'hosts', got int"),
])
def test_a_bad_fleet_file_is_one_line_naming_the_file_the_entry_and_the_key(tmp_path: Path, text: str,
                                                                           line: str) -> None:
    with pytest.raises(FleetError) as caught:
        load_fleet(fleet_file(tmp_path, text), HOSTS)
    message = caught.value.message.replace(str(tmp_path) + "/", "")
    assert message.startswith(line), message
    assert "\n" not in message and caught.value.hint  # one line, and what to do (or what is known) beside it


def test_a_missing_fleet_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="no such fleet file"):
        load_fleet(tmp_path / "nope.yaml", HOSTS)
