"""console.py: all terminal output; errors stay one greppable line, sizes read as people read them."""

from __future__ import annotations

import json

import pytest

from mlxpipe import console


@pytest.mark.parametrize(("n", "wide", "compact"), [
    (None, "-", "-"),
    (0, "0 B", "0B"),
    (1023, "1023 B", "1023B"),
    (1536, "1.5 KiB", "2K"),
    (47.6 * 1024**3, "47.6 GiB", "47.6G"),
    (3 * 1024**5, "3072.0 TiB", "3072.0T"),  # the largest unit goes on counting
    (-2048, "-2.0 KiB", "-2K"),
])
def test_sizes_are_binary_and_compact_for_tables(n: float | None, wide: str, compact: str) -> None:
    assert console.human_bytes(n) == wide
    assert console.short_bytes(n) == compact


def test_json_output_is_exactly_one_document_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_json({"split": [3, 3], "path": console})  # what JSON cannot hold is written as text
    out, err = capsys.readouterr()
    assert json.loads(out)["split"] == [3, 3] and err == ""


def test_an_error_is_one_line_on_stderr_however_long_and_whatever_it_holds(capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    monkeypatch.setattr(console, "err", Console(stderr=True, highlight=False, width=40))
    path = "/Volumes/a very long disk name/" + "deep/" * 20 + "[model].safetensors"
    console.error(f"cannot read {path}", "check the [disk]")
    console.warn("the ring crosses TCP")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"error: cannot read {path}", "hint: check the [disk]",
                                "warning: the ring crosses TCP"]  # Rich markup in a message is shown as is


def test_progress_bars_are_silent_off_a_terminal() -> None:
    calls = []
    with console.ProgressCallback("reading headers") as progress:  # stderr is not a terminal under pytest
        progress(1, 3)
        calls.append(progress._progress)
    assert calls == [None]
