"""worker/generation/constraints.py: structured output's grammar state (llguidance), in one process on a tiny
tokenizer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from fixtures.schemas import PERSON, schema_format
from fixtures.tiny_models import VOCAB_SIZE, TinyModels
from mlxpipe.worker.generation.constraints import Constraint, compile_error, grammar_of


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "strang"}, "strang"),
    ({"$ref": "#/definitions/nowhere"}, "nowhere"),
    ({"type": "string", "pattern": "(("}, "unclosed"),
])
def test_a_schema_llguidance_cannot_compile_says_why(schema: dict[str, Any], fragment: str) -> None:
    error = compile_error(schema_format(schema))
    assert error is not None and fragment in error


def test_the_mask_allows_only_json_of_the_schema_and_then_only_the_end(tiny_models: TinyModels) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_models["llama"])
    eos = set(tokenizer.eos_token_ids)
    rng = np.random.default_rng(0)
    for _ in range(5):
        constraint = Constraint(grammar_of(schema_format(PERSON)), tokenizer, VOCAB_SIZE, eos)
        tokens: list[int] = []
        while True:
            allowed = np.flatnonzero(constraint.allowed(VOCAB_SIZE))
            token = int(rng.choice(allowed))
            if token in eos:
                break
            constraint.accept(token)
            tokens.append(token)
            assert len(tokens) < 400
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)
        assert set(np.flatnonzero(constraint.allowed(VOCAB_SIZE))) <= eos  # complete: nothing but the end
