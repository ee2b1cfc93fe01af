"""``mlxpipe generate`` and ``chat`` end to end on ranks of this machine (127.0.0.1).

The installed console script runs as a user would run it; the pipeline's greedy
tokens must equal single-process mlx-lm's on the same checkpoint. The real demo
weights run once (the default two ranks, ``--prompt -``); the other runs use
``chat_model`` (the demo's tokenizer and template on tiny weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fixtures.cli import mlxpipe
from fixtures.demo_model import CHAT_LAYERS, DEMO_MAX_TOKENS, DEMO_PROMPT
from fixtures.option_reference import reference
from mlxpipe.launch.mlx_launch import LAUNCHER

pytestmark = pytest.mark.ranks


def test_greedy_tokens_equal_single_process(chat_model: Path) -> None:
    """Three ranks from a hostfile (the default two run below): SmolLM2's chat template, mlx-lm's greedy tokens."""
    expected = reference(chat_model, {"messages": [{"role": "user", "content": DEMO_PROMPT}],
                                      "max_tokens": DEMO_MAX_TOKENS})[0]
    result = mlxpipe(
        "generate", "--model", str(chat_model), "--hostfile", "hostfiles/local-3.json",
        "--prompt", DEMO_PROMPT, "--max-tokens", str(DEMO_MAX_TOKENS), "--json",
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["tokens"] == expected
    assert [r["rank"] for r in answer["ranks"]] == [0, 1, 2]
    # Rank 0 runs the LAST layers; together the ranks cover them all exactly once.
    assert answer["ranks"][0]["end"] == CHAT_LAYERS and answer["ranks"][-1]["start"] == 0
    assert sum(r["end"] - r["start"] for r in answer["ranks"]) == CHAT_LAYERS
    assert answer["generation_tokens"] == len(expected)
    assert answer["prompt_tokens"] > 0 and answer["generation_tps"] > 0
    assert all(r["peak_memory_gb"] > 0 for r in answer["ranks"])
    # MLX's mlx.launch, run by the controller's interpreter with its I/O threads sleeping (launch/mlx_launch.py).
    assert Path(answer["run_dir"], "command.txt").read_text().split()[:3] == [sys.executable, "-m", LAUNCHER]


def test_defaults_prompt_from_stdin_and_streamed_text(demo_model: Path, tmp_path: Path) -> None:
    """No --hostfile: two local ranks; '--prompt -' reads stdin; text streams to stdout, summary to stderr."""
    result = mlxpipe(
        "generate", "--model", str(demo_model), "--prompt", "-", "--max-tokens", "12", stdin=DEMO_PROMPT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    assert "generation" in result.stderr and "tok/s" in result.stderr
    assert "peak memory" in result.stderr


def test_chat_two_turns(chat_model: Path) -> None:
    """Two turns on one pipeline: the second reuses the first turn's prompt cache; each reply is mlx-lm's."""
    first = [{"role": "user", "content": DEMO_PROMPT}]
    reply = reference(chat_model, {"messages": first, "max_tokens": 8})[1]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And of Germany?"}]
    result = mlxpipe(
        "chat", "--model", str(chat_model), "--max-tokens", "8", stdin=f"{DEMO_PROMPT}\nAnd of Germany?\n\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{reply}\n{reference(chat_model, {'messages': second, 'max_tokens': 8})[1]}\n"
    assert result.stderr.count("tok/s") == 2
