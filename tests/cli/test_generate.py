"""``mlxpipe generate`` and ``chat``: flags refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.tiny_models import TinyModels
from typer.testing import CliRunner

from mlxpipe.cli import app


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "x"], "give --prompt or --prompts-file, not both"),
        (["--pipeline", "native"], "--prompts-file overlaps requests with the generic pipeline"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--output", "/no/such/dir/out.jsonl"], "no directory /no/such/dir"),
    ],
)
def test_generate_refuses_bad_batch_flags(tiny_models: TinyModels, tmp_path: Path, args: list[str], message: str) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n")
    argv = ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts), *args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_batch_flags_need_a_prompts_file(tiny_models: TinyModels) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompt", "x", "--concurrency", "2"])
    assert result.exit_code == 2
    assert "--concurrency and --output go with --prompts-file" in result.output


def test_generate_names_the_bad_line_before_launching(tiny_models: TinyModels, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": 1}\n')
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts)])
    assert result.exit_code == 2
    assert f"{prompts}:2: unknown key 'temperature'" in result.output
