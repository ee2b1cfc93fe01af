"""cluster/chips.py: Apple's published memory bandwidth by chip, binned chips told apart by performance cores."""

from __future__ import annotations

import pytest

from mlxpipe.cluster.chips import CHIPS, lookup


@pytest.mark.parametrize(("brand", "cores", "gbps"), [
    ("Apple M1", None, 68.25), ("Apple M2 Ultra", 16, 800), ("Apple  M4 Pro", 10, 273), ("apple m5", None, 153),
    ("Apple M3 Max", 10, 300), ("Apple M3 Max", 12, 400), ("Apple M4 Max", 10, 410), ("Apple M4 Max", 12, 546),
])
def test_a_listed_chip_has_apples_figure(brand: str, cores: int | None, gbps: float) -> None:
    row = lookup(brand, cores)
    assert row is not None and row.bandwidth == gbps * 1e9


@pytest.mark.parametrize(("brand", "cores"), [("Apple M3 Max", None), ("Apple M9", None), ("AMD EPYC", None)])
def test_an_unknown_chip_or_an_unknown_binning_is_measured_instead(brand: str, cores: int | None) -> None:
    assert lookup(brand, cores) is None


def test_every_row_names_its_source_and_every_family_has_its_pro_and_max() -> None:
    assert all(c.source and c.bandwidth > 0 for c in CHIPS)
    names = {c.name for c in CHIPS}
    for gen in ("M1", "M2", "M3", "M4", "M5"):
        assert {f"Apple {gen}", f"Apple {gen} Pro", f"Apple {gen} Max"} <= names
    assert {"Apple M1 Ultra", "Apple M2 Ultra", "Apple M3 Ultra"} <= names
