"""worker/stages/layers.py: finding a model's list of blocks."""

from __future__ import annotations

import pytest

from mlxpipe.errors import ModelError


def test_a_model_without_layers_is_refused() -> None:
    import mlx.nn as nn

    from mlxpipe.worker.stages.layers import find_layers

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ModelError, match="no list of layers"):
        find_layers(Flat())
