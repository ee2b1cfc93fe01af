"""worker/stages/cut.py: cutting a model for one rank's stage (the rank's place only; no rank starts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from mlx.utils import tree_flatten

from mlxpipe.errors import ModelError
from mlxpipe.worker.stages.cut import check_split, pipeline_generic


@dataclass(frozen=True)
class World:
    """Rank ``r`` of ``n``, as MLX's group reports it (cutting reads nothing else of it)."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize(("split", "message"), [
    ([3, 3, 1], "split [3, 3, 1] has 3 entries for 2 ranks"),
    ([2, 3], "split [2, 3] must be positive and sum to the model's 6 layers"),
    ([7, -1], "split [7, -1] must be positive and sum to the model's 6 layers"),
])
def test_a_split_that_does_not_cover_the_model_is_refused(split: list[int], message: str) -> None:
    with pytest.raises(ModelError) as info:
        check_split(split, 6, 2)
    assert str(info.value) == message


def test_a_rank_keeps_the_weights_of_its_own_layers_only(tiny_models: Any) -> None:
    from mlx_lm import load

    model, _ = load(str(tiny_models["llama"]))
    # Rank 1 of 2 with split [2, 4]: as in mlx-lm, rank 0 runs the last layers, so rank 1 runs 0-3.
    assert pipeline_generic(model, World(1, 2), [2, 4]) == (0, 4)
    weights = {name for name, _ in tree_flatten(model.parameters())}
    held = {int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")}
    assert held == {0, 1, 2, 3}
    assert any(name.startswith("model.embed_tokens") for name in weights)


def test_one_stage_is_the_model_unchanged(tiny_models: Any) -> None:
    from mlx_lm import load

    model, _ = load(str(tiny_models["llama"]))
    before = {name for name, _ in tree_flatten(model.parameters())}
    assert pipeline_generic(model, World(0, 1), [6]) == (0, 6)
    assert {name for name, _ in tree_flatten(model.parameters())} == before
