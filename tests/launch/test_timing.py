"""launch/timing.py: the controller's reading of the ranks' time reports (where the time goes)."""

from __future__ import annotations


def test_where_the_time_goes_names_each_rank_and_hop() -> None:
    from mlxpipe.launch.timing import where_time_goes

    def spent(compute: float, recv: float) -> dict[str, float]:
        wall = 10.0
        return {"compute": compute, "send": 0.5, "recv": recv, "sync": wall - compute - recv - 0.5, "idle": 0.0,
                "wall": wall, "busy": compute / wall}

    report = where_time_goes({1: spent(3.0, 0.0), 0: spent(9.0, 0.2), 2: spent(2.0, 0.0)})
    assert [(r["rank"], r["busy"]) for r in report["ranks"]] == [(0, 0.9), (1, 0.3), (2, 0.2)]
    assert report["hops"] == [{"from": 1, "to": 0, "wait_s": 0.2}, {"from": 2, "to": 1, "wait_s": 0.0}]
    assert report["busiest_rank"] == 0
    assert where_time_goes({}) == {}


def test_the_vision_towers_time_is_reported_apart() -> None:
    from mlxpipe.launch.timing import where_time_goes

    spent = {"compute": 4.0, "vision": 1.5, "send": 0.0, "recv": 0.0, "sync": 0.0, "idle": 0.0, "wall": 5.0,
             "busy": 0.8}
    older = {k: v for k, v in spent.items() if k != "vision"}
    report = where_time_goes({1: spent, 0: older})
    assert [r["vision_s"] for r in report["ranks"]] == [0.0, 1.5]
