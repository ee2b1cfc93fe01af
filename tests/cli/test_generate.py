"""``mlxpipe generate`` and ``chat``: flags refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.cli import NOT_STARTED, cli, mlxpipe
from fixtures.tiny_models import TinyModels
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
def test_generate_refuses_bad_batch_flags(
    tiny_models: TinyModels, tmp_path: Path, args: list[str], message: str
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n")
    argv = ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts), *args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_batch_flags_need_a_prompts_file(tiny_models: TinyModels) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", str(tiny_models["llama"]), "--prompt", "x", "--concurrency", "2"]
    )
    assert result.exit_code == 2
    assert "--concurrency and --output go with --prompts-file" in result.output


def test_generate_names_the_bad_line_before_launching(tiny_models: TinyModels, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": 1}\n')
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts)])
    assert result.exit_code == 2
    assert f"{prompts}:2: unknown key 'temperature'" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-k", "-2"], "error: --top-k must be >= 0 (0: off), got -2"),
        (["--xtc-threshold", "0.9"], "error: --xtc-threshold must be in [0, 0.5], got 0.9"),
        (["--kv-bits", "7"], "error: --kv-bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
        (["--kv-group-size", "16"], "error: --kv-group-size must be one of 32, 64, 128, got 16"),
        (["--max-kv-size", "0"], "error: --max-kv-size must be at least 1, got 0"),
        (["--chat-template-config", "{nope"], "error: --chat-template-config is not valid JSON"),
        (["--chat-template-config", "[1]"], "error: --chat-template-config must be a JSON object"),
        (["--context", "0"], "error: --context must be at least 1, got 0"),
        (["--adapter-path", "/nonexistent"], "error: --adapter-path /nonexistent: no adapter_config.json or "
                                              "adapters.safetensors there"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith(message), result.output


def test_context_reaches_the_fit_check_before_anything_starts(tiny_models, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model", str(tiny_models["llama"]),
                                      "--context", "100000000"])
    assert result.exit_code == 1, result.output
    assert "at --context 100000000" in result.output


def test_trust_remote_code_is_off_unless_asked(demo_model: Path, tmp_path: Path, jobs_not_started: list[Any]) -> None:
    hostfile = tmp_path / "local-2.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    for flags in ([], ["--trust-remote-code"]):
        result = cli("generate", "--model", str(demo_model), "--hostfile", str(hostfile), "--prompt", "Hi", *flags)
        assert result.exit_code == 1 and NOT_STARTED in result.stderr
    assert [job.trust_remote_code for job in jobs_not_started] == [False, True]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "x", "--max-tokens", "0"], "error: --max-tokens must be at least 1, got 0"),
        (["--prompt", "x", "--temp", "-1"], "error: --temp must be >= 0, got -1"),
        (["--prompt", "x", "--top-p", "1.5"], "error: --top-p must be in (0, 1], got 1.5"),
        (["--prompt", "x", "--min-p", "1"], "error: --min-p must be in [0, 1), got 1"),
        (["--prompt", "x", "--pipeline", "magic"], "error: --pipeline 'magic': use one of generic, native"),
        (["--max-tokens", "3"], "error: --prompt is required ('-' reads standard input)"),
    ],
)
def test_usage_errors_exit_2_before_launch(demo_model: Path, args: list[str], message: str) -> None:
    result = mlxpipe("generate", "--model", str(demo_model), *args)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == message


# ---------------------------------------------------------------- refused before anything starts


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts-file", "p.txt", "--concurrency", "2"],
         "error: --concurrency: with --draft-model the prompts run one at a time"),
        (["--max-kv-size", "64"], "error: --max-kv-size does not work with --draft-model"),
        (["--num-draft-tokens", "0"], "error: --num-draft-tokens must be at least 1, got 0"),
    ],
)
def test_a_draft_flag_combination_is_refused_in_one_line(models, args: list[str], message: str) -> None:
    prompt = [] if "--prompts-file" in args else ["--prompt", "hi"]
    result = CliRunner().invoke(app, ["generate", *prompt, "--model", str(models["target"]),
                                      "--draft-model", str(models["draft"]), *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[0].startswith(message), result.output


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_draft_model_that_is_neither_directory_nor_hub_id_is_refused(models, command: str) -> None:
    prompt = ["--prompt", "hi"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, *prompt, "--model", str(models["target"]),
                                      "--draft-model", "./no/such/draft"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[0] == (
        "error: --draft-model ./no/such/draft: no such directory, and not a hub repo id"), result.output


def test_a_draft_model_missing_from_the_hub_is_refused_before_launch(models, hub_env) -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model", str(models["target"]),
                                      "--draft-model", "tiny/no-such-draft"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[0].startswith("error: tiny/no-such-draft"), result.output
