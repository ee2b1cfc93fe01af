"""download/progress.py: the hosts' bars."""

from __future__ import annotations

from mlxpipe.download.progress import download_progress


def test_download_bars_are_silent_off_a_terminal() -> None:
    with download_progress([object()]) as update:  # stderr is not a terminal under pytest
        assert update is None
