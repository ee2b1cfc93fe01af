"""worker/measure/calibrate.py: a layer's time taken apart from what every forward pass costs."""

from __future__ import annotations

import pytest

from mlxpipe.worker.measure.calibrate import DEPTHS, _fit


def test_a_layers_time_is_the_slope_over_depth() -> None:
    assert _fit([0.5 + 2.0 * d for d in DEPTHS]) == pytest.approx((0.5, 2.0))
