"""plan/cluster_facts.py: the cluster's facts survive their JSON file, and a file that is not one is refused by name."""

from __future__ import annotations

import json

import pytest

from fixtures.cluster_facts import FACTS
from mlxpipe.errors import HostfileError
from mlxpipe.plan.cluster_facts import Calibration, ClusterFacts


def test_facts_survive_their_json() -> None:
    assert ClusterFacts.from_json(json.loads(json.dumps(FACTS.to_json())), "f.json") == FACTS


def test_a_link_is_found_either_way_round_and_only_between_neighbours() -> None:
    assert FACTS.link(1, 0) == FACTS.link(0, 1) == FACTS.links[0]
    assert FACTS.link(0, 2) is None


def test_facts_say_whose_they_are() -> None:
    assert FACTS.matches([("a", ["10.0.0.1"]), ("b", ["10.0.0.2"])])
    assert not FACTS.matches([("a", ["10.0.0.1"]), ("b", ["10.0.0.3"])])
    assert not FACTS.matches([("b", ["10.0.0.2"]), ("a", ["10.0.0.1"])])


def test_calibrating_every_host_alike() -> None:
    cal = Calibration(1.0, 2.0, 3.0)
    assert FACTS.with_calibration(cal).calibrated() and not FACTS.calibrated()


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=0), "f.json: facts of version 0, this mlxpipe reads 1"),
    (lambda d: d.pop("hosts"), "f.json: not a cluster facts file (KeyError: 'hosts')"),
    (lambda d: d["links"][0].update(latency=-1), "f.json: not a cluster facts file (ValueError: 'latency' must be a "
                                                  "positive number, got -1)"),
])
def test_a_file_that_is_not_facts_is_refused_by_name(change, message: str) -> None:
    data = FACTS.to_json()
    change(data)
    with pytest.raises(HostfileError) as info:
        ClusterFacts.from_json(data, "f.json")
    assert info.value.message == message
    assert info.value.hint == "measure them again: mlxpipe doctor --links --hostfile HOSTFILE"
