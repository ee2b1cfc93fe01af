"""model/facts.py: what a config says (layers that share KV caches)."""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.plan_inputs import GEMMA3N
from mlxpipe.model.facts import kv_sharing_groups


@pytest.mark.parametrize(
    ("config", "groups"),
    [
        (GEMMA3N, [(18, 29)]),
        ({"num_kv_shared_layers": 0, "layer_types": GEMMA3N["layer_types"]}, []),
        ({"num_hidden_layers": 30}, []),
        # No layer types: Gemma's pattern (every sliding_window_pattern-th layer is full).
        ({"num_hidden_layers": 10, "num_kv_shared_layers": 4, "sliding_window_pattern": 5}, [(4, 9)]),
        ({"layer_types": ["full_attention"] * 4, "num_kv_shared_layers": 4}, [(0, 3)]),
        # AFM: the KV-reuse layers, run last, read the cache of the layer before them.
        ({"num_layers": 56, "num_kv_reuse_layers": 21}, [(34, 55)]),
    ],
)
def test_kv_sharing_groups(config: dict[str, Any], groups: list[tuple[int, int]]) -> None:
    assert kv_sharing_groups(config) == groups
