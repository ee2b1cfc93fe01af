"""launch/batch.py: the prompts file, results in input order and on disk as they finish, where the time goes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fixtures.generation_options import OPTIONS
from mlxpipe.errors import UsageError
from mlxpipe.launch.batch import InOrder, RequestResult, ResultsFile, read_prompts
from mlxpipe.protocol.request import Request


def test_results_are_handed_on_in_input_order() -> None:
    seen: list[Any] = []
    ordered = InOrder(lambda r: seen.append(r.id))
    for index in (2, 0, 3, 1):
        ordered.add(index, RequestResult(index, "", [], 0, 0, 0.0, 0.0, 0.0))
        if index == 0:
            assert seen == [0]
    assert seen == [0, 1, 2, 3]


DEFAULTS = Request(max_tokens=16)


def _result(id: Any) -> RequestResult:
    return RequestResult(id=id, text=f"text {id}", tokens=[1, 2], prompt_tokens=3, generation_tokens=2,
                         latency=1.0, ttft=0.5, tps=2.0, finish_reason="length")


def test_results_file_keeps_each_result_as_it_finishes_and_replaces_output_whole(tmp_path: Path) -> None:
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    out = tmp_path / "results.jsonl"
    out.write_text("old\n")
    saved = ResultsFile(out)
    saved.add(_result("b"))
    saved.add(_result("a"))
    partial = [json.loads(line)["id"] for line in (tmp_path / "results.jsonl.partial").read_text().splitlines()]
    assert partial == ["b", "a"]  # on disk at once, in the order they finished
    assert out.read_text() == "old\n"  # untouched until the batch is whole
    saved.finish([_result("a"), _result("b")])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def test_results_file_after_a_failure_keeps_what_finished(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    saved = ResultsFile(out)
    saved.add(_result(7))
    assert saved.abandon() == f"the 1 results that finished are in {out}.partial"
    assert json.loads((tmp_path / "results.jsonl.partial").read_text())["text"] == "text 7"
    assert not out.exists()
    nothing = ResultsFile(out)
    assert nothing.abandon() is None
    assert not (tmp_path / "results.jsonl.partial").exists()


def test_results_file_refuses_a_path_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "results.jsonl.partial").mkdir()
    with pytest.raises(UsageError, match=r"--output .*results.jsonl: cannot write .*results.jsonl.partial"):
        ResultsFile(tmp_path / "results.jsonl")


def test_a_plain_file_holds_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("First prompt\n\n  Second, indented\n")
    assert read_prompts(path, DEFAULTS) == [
        replace(DEFAULTS, id=1, prompt="First prompt"),
        replace(DEFAULTS, id=3, prompt="  Second, indented"),
    ]


def test_json_lines_carry_per_prompt_options(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "a", "max_tokens": 4, "temp": 0.7, "seed": 3}\n'
        '{"id": "x", "messages": [{"role": "user", "content": "b"}]}\n'
    )
    first, second = read_prompts(path, DEFAULTS)
    assert first == replace(DEFAULTS, id=1, prompt="a", max_tokens=4, temp=0.7, seed=3)
    assert second == replace(DEFAULTS, id="x", messages=[{"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a",}', "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"prompt": "a", "max_tokenz": 3}', "unknown key 'max_tokenz'"),
        ('{"prompt": "a", "messages": []}', "exactly one of 'prompt' and 'messages'"),
        ('{"max_tokens": 3}', "exactly one of 'prompt' and 'messages'"),
        ('{"prompt": 3}', "'prompt' must be str, got 3"),
        ('{"prompt": "a", "max_tokens": true}', "'max_tokens' must be int, got true"),
        ('{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be at least 1"),
        ('{"prompt": "a", "top_p": 1.5}', "'top_p' must be in (0, 1], got 1.5"),
        ('{"prompt": "a", "temp": -0.5}', "'temp' must be >= 0, got -0.5"),
        ('{"messages": [{"role": "user"}]}', "'messages' must be a non-empty list"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(UsageError) as info:
        read_prompts(path, DEFAULTS)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_or_missing_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UsageError, match="no prompts"):
        read_prompts(empty, DEFAULTS)
    with pytest.raises(UsageError, match="cannot read the prompts file"):
        read_prompts(tmp_path / "missing.txt", DEFAULTS)


def test_prompts_file_lines_take_every_option_by_its_name(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": key, **request} for key, request in OPTIONS.items()]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    requests = read_prompts(path, Request(max_tokens=3))
    assert [r.id for r in requests] == list(OPTIONS)
    assert requests[1].xtc_probability == 1.0 and requests[3].logit_bias == {101: 3.0, 116: 2.0}
    assert requests[6].extra_eos_token == ("<|endoftext|>",) and requests[8].kv_bits == 4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"top_k": -1}, ":1: 'top_k' must be >= 0"),
        ({"top_k": 1.5}, ":1: 'top_k' must be int, got 1.5"),
        ({"logit_bias": {"x": 1}}, ":1: 'logit_bias' must be an object of token ids"),
        ({"extra_eos_token": [1]}, ":1: 'extra_eos_token' must be a string or a list of strings"),
        ({"kv_bits": 9}, ":1: 'kv_bits' must be one of 2, 3, 4, 5, 6, 8, got 9"),
        ({"chat_template_config": "x"}, ":1: 'chat_template_config' must be dict"),
    ],
)
def test_a_bad_option_on_a_line_names_the_line(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", **options}) + "\n")
    with pytest.raises(UsageError) as info:
        read_prompts(path, Request())
    assert f"{path}{message}" in str(info.value)
