"""serve/cluster_view.py: what the cluster's page is fed."""

from __future__ import annotations

from mlxpipe.serve.cluster_view import History


def test_the_history_is_a_bounded_ring_of_rates() -> None:
    history = History(size=3)
    history.sample(100.0, tokens=0, in_flight=0)
    history.sample(102.0, tokens=10, in_flight=2)
    history.sample(103.0, tokens=10, in_flight=1)
    history.sample(103.5, tokens=13, in_flight=1)
    assert [(s["t"], s["tps"], s["in_flight"]) for s in history.samples] == [(102.0, 5.0, 2), (103.0, 0.0, 1),
                                                                             (103.5, 6.0, 1)]
