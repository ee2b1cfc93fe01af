"""``mlxpipe generate`` and ``chat`` end to end on ranks of this machine (127.0.0.1).

The installed console script runs as a user would run it; the pipeline's greedy
tokens must equal single-process mlx-lm's on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.cli import mlxpipe
from fixtures.demo_model import DEMO_MAX_TOKENS, DEMO_PROMPT

pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("hostfile", ["local-2.json", "local-3.json"])
def test_greedy_tokens_equal_single_process(demo_model: Path, demo_reference: list[int], hostfile: str) -> None:
    result = mlxpipe(
        "generate", "--model", str(demo_model), "--hostfile", f"hostfiles/{hostfile}",
        "--prompt", DEMO_PROMPT, "--max-tokens", str(DEMO_MAX_TOKENS), "--json",
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["tokens"] == demo_reference
    ranks = 3 if "3" in hostfile else 2
    assert [r["rank"] for r in answer["ranks"]] == list(range(ranks))
    # Rank 0 runs the LAST layers; together the ranks cover all 30 exactly once.
    assert answer["ranks"][0]["end"] == 30 and answer["ranks"][-1]["start"] == 0
    assert sum(r["end"] - r["start"] for r in answer["ranks"]) == 30
    assert answer["generation_tokens"] == DEMO_MAX_TOKENS
    assert answer["prompt_tokens"] > 0 and answer["generation_tps"] > 0
    assert all(r["peak_memory_gb"] > 0 for r in answer["ranks"])
    assert Path(answer["run_dir"], "command.txt").read_text().split()[0].endswith("mlx.launch")


def test_defaults_prompt_from_stdin_and_streamed_text(demo_model: Path, tmp_path: Path) -> None:
    """No --hostfile: two local ranks; '--prompt -' reads stdin; text streams to stdout, summary to stderr."""
    result = mlxpipe(
        "generate", "--model", str(demo_model), "--prompt", "-", "--max-tokens", "12", stdin=DEMO_PROMPT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    assert "generation" in result.stderr and "tok/s" in result.stderr
    assert "peak memory" in result.stderr


def test_chat_two_turns(demo_model: Path) -> None:
    """Two turns on one pipeline: the second reuses the first turn's prompt cache."""
    result = mlxpipe(
        "chat", "--model", str(demo_model), "--max-tokens", "12",
        stdin="What is the capital of France?\nAnd of Germany?\n\n",
    )
    assert result.returncode == 0, result.stderr
    answers = [line for line in result.stdout.splitlines() if line.strip()]
    assert answers[0] == "The capital of France is Paris."
    assert "Berlin" in answers[1]
    assert result.stderr.count("tok/s") == 2
