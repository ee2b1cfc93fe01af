"""worker/load.py: what a rank loads of the checkpoint and the adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.generation_options import SPLIT
from mlxpipe.errors import ModelError


def test_a_rank_loads_only_its_own_layers_adapters(option_model: tuple[Path, Path], tmp_path: Path) -> None:
    """Rank 0's share with an adapter file holding no other rank's tensors: same weights as mlx-lm's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from mlxpipe.worker.load import load_local_adapters
    from mlxpipe.worker.stages.cut import pipeline_generic

    checkpoint, adapters = option_model
    own = tmp_path / "rank0-adapters"
    own.mkdir()
    (own / "adapter_config.json").write_text((adapters / "adapter_config.json").read_text())
    weights = mx.load(str(adapters / "adapters.safetensors"))
    mx.save_safetensors(str(own / "adapters.safetensors"),
                        {k: v for k, v in weights.items() if ".layers.4." in k or ".layers.5." in k})

    class Rank0:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    model, _ = load(str(checkpoint))
    start, end = pipeline_generic(model, Rank0(), SPLIT)
    load_local_adapters(model, own, start, end, 0)
    reference, _ = load(str(checkpoint), adapter_path=str(adapters))
    mine = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(reference.parameters()))
    local = [k for k in theirs if ".layers.4." in k or ".layers.5." in k]
    assert any(k.endswith("lora_b") for k in local)
    for k in local:
        assert mx.array_equal(mine[k], theirs[k]), k
    assert not any(".layers.1." in k and "lora" in k for k in mine)  # a stand-in: nothing to adapt


def test_check_pipelinable_accepts_a_model(tiny_models) -> None:
    from mlxpipe.worker.load import check_pipelinable

    check_pipelinable(tiny_models["gemma3_text"])
    check_pipelinable(tiny_models["qwen2"], mode="native")


def test_check_pipelinable_refuses_native_without_pipeline(tiny_models) -> None:
    from mlxpipe.worker.load import check_pipelinable

    with pytest.raises(ModelError, match="no native"):
        check_pipelinable(tiny_models["llama"], mode="native")
