"""Apple silicon's published memory bandwidth, by chip: what a decode step of a large model is bound by.

Each figure is Apple's own, from the chip's announcement on Apple Newsroom (the page named beside
it; its "up to" figure is the full chip's) or the Tech Specs of the MacBook Pro that first shipped the
binned variant of a chip sold in two bandwidths. The binned M3 Max and M4 Max
(fewer GPU cores, narrower memory bus) are told apart by their performance cores, which ``sysctl
hw.perflevel0.physicalcpu`` gives: 10 on the binned chips, 12 on the full ones. A chip not listed
(a newer one, or a Linux machine's CPU) is measured instead (``worker/measure/link_probe.py``), and the facts
file says which.
"""

from __future__ import annotations

from dataclasses import dataclass

GBPS = 1e9  # Apple's GB/s are decimal


@dataclass(frozen=True)
class Chip:
    """One row: a chip (and, for a binned one, its performance cores), its bandwidth, where Apple says so."""

    name: str  # the brand string: "Apple M2 Ultra"
    bandwidth: float  # bytes/s
    source: str
    performance_cores: int | None = None  # None: every variant of the name


_NEWS = "https://www.apple.com/newsroom/"
M1_PRO_MAX = _NEWS + "2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"
M1_ULTRA = _NEWS + "2022/03/apple-unveils-m1-ultra-the-worlds-most-powerful-chip-for-a-personal-computer/"
M2 = _NEWS + "2022/06/apple-unveils-m2-with-breakthrough-performance-and-capabilities/"
M2_PRO_MAX = _NEWS + "2023/01/apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"
M2_ULTRA = _NEWS + "2023/06/apple-introduces-m2-ultra/"
M3_FAMILY = _NEWS + "2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"
M3_MAX_SPECS = "Apple's Tech Specs of MacBook Pro (14-inch, M3 Pro or M3 Max, Nov 2023): 14-core CPU M3 Max"
M3_ULTRA = _NEWS + "2025/03/apple-reveals-m3-ultra-taking-apple-silicon-to-a-new-extreme/"
M4 = _NEWS + "2024/05/apple-introduces-m4-chip/"
M4_PRO_MAX = _NEWS + "2024/10/apple-introduces-m4-pro-and-m4-max/"
M4_MAX_SPECS = "Apple's Tech Specs of MacBook Pro (14-inch, M4 Pro or M4 Max, 2024): 14-core CPU M4 Max"
M5 = _NEWS + "2025/10/apple-unleashes-m5-the-next-big-leap-in-ai-performance-for-apple-silicon/"
M5_PRO_MAX = "Apple Newsroom, 3 March 2026: the MacBook Pro with M5 Pro and M5 Max"
# Apple gave no bandwidth for the M1; its LPDDR4X-4266 on a 128-bit bus moves 4266e6 x 16 bytes a second.
M1_DERIVED = "derived: LPDDR4X-4266 x 128-bit bus (Apple publishes no figure)"

CHIPS: tuple[Chip, ...] = (
    Chip("Apple M1", 68.25 * GBPS, M1_DERIVED),
    Chip("Apple M1 Pro", 200 * GBPS, M1_PRO_MAX),
    Chip("Apple M1 Max", 400 * GBPS, M1_PRO_MAX),
    Chip("Apple M1 Ultra", 800 * GBPS, M1_ULTRA),
    Chip("Apple M2", 100 * GBPS, M2),
    Chip("Apple M2 Pro", 200 * GBPS, M2_PRO_MAX),
    Chip("Apple M2 Max", 400 * GBPS, M2_PRO_MAX),
    Chip("Apple M2 Ultra", 800 * GBPS, M2_ULTRA),
    Chip("Apple M3", 100 * GBPS, M3_FAMILY),
    Chip("Apple M3 Pro", 150 * GBPS, M3_FAMILY),
    Chip("Apple M3 Max", 300 * GBPS, M3_MAX_SPECS, performance_cores=10),  # 14-core CPU, 30-core GPU
    Chip("Apple M3 Max", 400 * GBPS, M3_FAMILY, performance_cores=12),  # 16-core CPU, 40-core GPU
    Chip("Apple M3 Ultra", 819 * GBPS, M3_ULTRA),
    Chip("Apple M4", 120 * GBPS, M4),
    Chip("Apple M4 Pro", 273 * GBPS, M4_PRO_MAX),
    Chip("Apple M4 Max", 410 * GBPS, M4_MAX_SPECS, performance_cores=10),  # 14-core CPU, 32-core GPU
    Chip("Apple M4 Max", 546 * GBPS, M4_PRO_MAX, performance_cores=12),  # 16-core CPU, 40-core GPU
    Chip("Apple M5", 153 * GBPS, M5),
    Chip("Apple M5 Pro", 307 * GBPS, M5_PRO_MAX),
    Chip("Apple M5 Max", 614 * GBPS, M5_PRO_MAX),  # Apple's "up to": its 40-core GPU
)


def lookup(name: str, performance_cores: int | None = None) -> Chip | None:
    """The row of ``name`` (a brand string as ``sysctl machdep.cpu.brand_string`` gives it), its binned
    variant told apart by ``performance_cores``; None for a chip not listed, or a binned one whose cores
    are unknown (the bandwidth is measured then)."""
    rows = [c for c in CHIPS if c.name.lower() == " ".join(name.split()).lower()]
    if len(rows) == 1:
        return rows[0]
    return next((c for c in rows if c.performance_cores == performance_cores), None)
