"""The suite's figures at the end of a CI run: its wall time and the 30 slowest tests, from pytest's JUnit files.

    python .ci/slowest.py SECONDS FILE.xml [FILE.xml ...]

``make test`` runs the suite in two parts (the unit tier on two workers, then the tests that start ranks or
build the ssh cluster, one at a time), so pytest's own ``--durations`` would print two lists; this prints one.
A test's time is its setup, call and teardown together, as ``--durations`` counts them.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 30


def test_path(classname: str) -> str:
    """``tests/x/test_y.py`` or ``tests/x/test_y.py::TestClass`` for JUnit's dotted class name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if module.exists():
            return "::".join([str(module), *parts[cut:]])
    return classname


def durations(files: list[Path]) -> dict[str, float]:
    """Test id -> seconds, over every JUnit file that exists (a part that did not run has none)."""
    times: dict[str, float] = {}
    for path in files:
        if not path.exists():
            continue
        for case in ET.parse(path).iter("testcase"):
            name = f"{test_path(case.get('classname', ''))}::{case.get('name')}"
            times[name] = times.get(name, 0.0) + float(case.get("time") or 0.0)
    return times


def main(argv: list[str]) -> int:
    wall = int(argv[0])
    times = durations([Path(a) for a in argv[1:]])
    print(f"\nthe suite: {len(times)} tests, {wall // 60}:{wall % 60:02d} wall time (make test)")
    print(f"the {min(SLOWEST, len(times))} slowest (setup, call and teardown):")
    for name, seconds in sorted(times.items(), key=lambda item: -item[1])[:SLOWEST]:
        print(f"{seconds:8.2f}s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
