"""lora/report.py: what ``mlxpipe lora`` prints, as mlx_lm.lora prints it or as one JSON object per line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxpipe.lora.report import LoraReporter
from mlxpipe.lora.training import RankMemory, StepReport, TrainResult

RESULT = TrainResult(steps=[StepReport(1, 2.5, 100, 1e-4, 0.5), StepReport(2, 2.0, 100, 1e-4, 0.5)],
                     val_losses={2: 1.75}, test_loss=1.5, saved=["out/adapters.safetensors"],
                     ranks=[RankMemory(0, "127.0.0.1", (2, 4), 0.25, 0.8)], train_seconds=2.0)


def run_through(reporter: LoraReporter) -> None:
    reporter.step(RESULT.steps[0])
    reporter.train(1, 2.5, 1e-4, 2.0, 200.0, 100, 0.25)
    reporter.val(2, 1.75, 0.125)
    reporter.saved(2, Path("out/0000002_adapters.safetensors"))
    reporter.test(1.5)
    reporter.summary(RESULT)


def test_json_lines_one_object_each_for_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    run_through(LoraReporter(json_out=True))
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["type"] for line in lines] == ["step", "train", "val", "save", "test", "summary"]
    assert lines[0] == {"type": "step", "iteration": 1, "loss": 2.5, "tokens": 100, "learning_rate": 1e-4,
                        "seconds": 0.5}
    assert lines[3]["path"] == "out/0000002_adapters.safetensors"
    assert lines[5]["tokens_per_second"] == 100.0 and lines[5]["ranks"][0]["layers"] == [2, 4]
    assert err == ""


def test_terminal_lines_as_mlx_lm_lora_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    run_through(LoraReporter(json_out=False))
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "Iter 1: Train loss 2.500, Learning Rate 1.000e-04, It/sec 2.000, Tokens/sec 200.000, Trained Tokens 100, "
        "Peak mem 0.250 GB",
        "Iter 2: Val loss 1.750, Val took 0.125s",
        "Iter 2: Saved adapter weights to out/0000002_adapters.safetensors.",
        "Test loss 1.500, Test ppl 4.482.",
        "Saved final weights to out/adapters.safetensors.",
    ]
    assert "rank 0 (127.0.0.1): layers 2-3, peak memory 0.250 GB, busy 80% of the steps' time" in err
    assert "2 steps, 100.0 trained tokens/s" in err
