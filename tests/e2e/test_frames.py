"""Frames through real ssh terminals: a flood of long events from every rank of the ssh test cluster arrives whole."""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.flood import check_flood, flood


@pytest.mark.ranks
@pytest.mark.cluster
def test_a_flood_through_ssh_terminals_arrives_whole(cluster: Any) -> None:
    check_flood(flood(cluster.hostfile(3), 1000), 1000)
