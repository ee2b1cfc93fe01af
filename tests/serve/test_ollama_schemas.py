"""serve/ollama_schemas.py: Ollama's chat and generate bodies as jobs for the ranks, on the demo tokenizer."""

from __future__ import annotations

from itertools import count
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxpipe.serve.door import ApiError, ServerSettings
from mlxpipe.serve.ollama_schemas import check_model, parse

SETTINGS = ServerSettings(model_id="demo", api_key=None, context=512)


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Any:
    return load_tokenizer(demo_model)


def ids() -> Any:
    numbers = count()
    return lambda: f"req-{next(numbers)}"


def test_a_chat_becomes_the_templated_tokens_with_ollamas_options(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    parsed = parse({"model": "demo:latest", "messages": messages, "stream": False,
                    "options": {"temperature": 0.5, "seed": 3, "num_predict": 7, "stop": ["\n\n"]}},
                   True, SETTINGS, tokenizer, ids())
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert parsed.request.tokens == tokenizer.encode(expected, add_special_tokens=False)
    assert (parsed.request.temp, parsed.request.seed, parsed.request.max_tokens) == (0.5, 3, 7)
    assert (parsed.stream, parsed.stops, parsed.model, parsed.request.id) == (False, ["\n\n"], "demo:latest", "req-0")


def test_generate_applies_the_template_unless_raw_and_runs_until_the_context_ends(tokenizer: Any) -> None:
    raw = parse({"prompt": "Once upon", "raw": True, "options": {"num_predict": -1}}, False, SETTINGS, tokenizer,
                ids())
    assert raw.request.ignore_chat_template and raw.stream  # Ollama streams unless told not to
    assert raw.request.max_tokens == SETTINGS.context - len(raw.request.tokens)  # -1: until the context is full
    templated = parse({"prompt": "Once upon"}, False, SETTINGS, tokenizer, ids())
    assert len(templated.request.tokens) > len(raw.request.tokens)


@pytest.mark.parametrize(("body", "chat", "status", "param"), [
    ({"model": "other", "messages": []}, True, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "format": "json"}, True, 400, "format"),
    ({"messages": [{"role": "user", "content": "x"}], "options": {"temperature": -1}}, True, 400,
     "options.temperature"),
    ({"prompt": ""}, False, 400, "prompt"),
    ({"prompt": "x", "images": ["aGk="]}, False, 400, "images"),
    ({"prompt": "x " * 600}, False, 400, "prompt"),  # beyond the context
])
def test_a_bad_body_names_its_field(tokenizer: Any, body: dict[str, Any], chat: bool, status: int, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body, chat, SETTINGS, tokenizer, ids())
    assert (info.value.status, info.value.param) == (status, param)


def test_the_served_model_answers_to_its_name_with_or_without_latest() -> None:
    assert check_model({}, SETTINGS) == "demo"
    assert check_model({"model": "demo:latest"}, SETTINGS) == "demo:latest"
