"""plan/costs.py and the metadata's KV bytes: what each layer's cache costs per token, sliding windows included."""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.plan_inputs import SLIDING, T, hosts, meta, uniform
from mlxpipe.model.metadata import ModelMetadata, kv_bytes_per_token
from mlxpipe.plan.costs import kv_bytes
from mlxpipe.plan.shard import make_plan

# --- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "norm_dtype", "per_token"),
    [
        # GQA: keys and values for each KV head.
        ({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}, "BF16", 2 * 8 * 128 * 2),
        # head_dim from hidden_size / heads.
        ({"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": None, "hidden_size": 2048},
         "BF16", 2 * 4 * 128 * 2),
        # MHA: no num_key_value_heads.
        ({"num_attention_heads": 8, "num_key_value_heads": None, "head_dim": None, "hidden_size": 512},
         "BF16", 2 * 8 * 64 * 2),
        ({"torch_dtype": "float32"}, "BF16", 2 * 2 * 16 * 4),
        ({"torch_dtype": None, "dtype": "float16"}, "F32", 2 * 2 * 16 * 2),
        # Untyped (quantized) checkpoints compute in the dtype of their norms.
        ({"torch_dtype": None}, "F32", 2 * 2 * 16 * 4),
        # MLA: one latent plus the rope key per token, whatever the head counts.
        ({"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
         "BF16", (512 + 64) * 2),
    ],
    ids=["gqa", "head-dim-from-hidden", "mha", "float32", "dtype-key", "norm-dtype", "mla"],
)
def test_kv_bytes_per_token(config: dict[str, Any], norm_dtype: str, per_token: int) -> None:
    tensors = [T(f"model.layers.{i}.input_layernorm.weight", 64, "w", norm_dtype) for i in range(3)]
    m = meta(tensors, 3, **config)
    assert kv_bytes_per_token(m) == [(per_token, None)] * 3
    plan = make_plan(m, hosts(2), strategy="even")
    assert [r.kv_bytes_per_1k for r in plan.ranks] == [2 * per_token * 1000, per_token * 1000]


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3},
         [128, None, 128, None, 128, None]),
        ({"sliding_window": 512, "sliding_window_pattern": 3}, [512, 512, None, 512, 512, None]),
        ({"sliding_window": 64, "model_type": "gemma2"}, [64, None, 64, None, 64, None]),
        ({"sliding_window": 4096}, [None] * 6),  # no per-layer pattern: assume every layer grows
        ({"layer_types": ["sliding_attention"] * 6}, [None] * 6),  # no window size: unbounded
    ],
    ids=["layer-types", "pattern", "gemma2", "window-only", "types-only"],
)
def test_sliding_window_layers(config: dict[str, Any], windows: list[int | None]) -> None:
    m = uniform(6, 1024, **config)
    assert kv_bytes_per_token(m) == [(SLIDING, w) for w in windows]


def test_sliding_window_layers_stop_growing() -> None:
    m = uniform(6, 1024, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 3)
    plan = make_plan(m, hosts(2), split=[2, 4])
    # rank 0: layers 4 (sliding) and 5 (full); rank 1: 0-3, two of each
    assert [r.kv_bytes_per_1k for r in plan.ranks] == [SLIDING * (128 + 1000), SLIDING * 2 * (128 + 1000)]
    kv = kv_bytes_per_token(m)
    assert [kv_bytes(kv, t) for t in (0, 1, 128, 129, 10_000)] == [
        0, 6 * SLIDING, 6 * 128 * SLIDING, SLIDING * 3 * (128 + 129), SLIDING * 3 * (128 + 10_000),
    ]


def test_nested_text_config() -> None:
    text = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6}
    m = ModelMetadata(
        source="vlm", config={"model_type": "gemma3", "text_config": text, "torch_dtype": "bfloat16"},
        tensors=tuple(T(f"language_model.model.layers.{i}.mlp.down_proj.weight", 1024, "w") for i in range(6)),
        file_sizes={"w": 6144},
    )
    assert (m.model_type, m.num_layers) == ("gemma3", 6)  # mlx-lm loads it by the top-level type
    assert kv_bytes_per_token(m) == [(2 * 4 * 256 * 2, 1024)] * 5 + [(2 * 4 * 256 * 2, None)]


def test_vision_tower_counts_on_the_first_stage_only() -> None:
    """A vision-language model's tower and projector: held, and fetched, by the rank of layer 0 alone."""
    from mlxpipe.model.metadata import Tensor
    from mlxpipe.plan.costs import model_costs

    config = {"model_type": "qwen2_5_vl", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vision_config": {"depth": 1}}
    tensors = (
        Tensor("language_model.model.embed_tokens.weight", "F32", (16, 8), "a.safetensors"),
        Tensor("language_model.model.layers.0.mlp.up_proj.weight", "F32", (8, 8), "a.safetensors"),
        Tensor("language_model.model.layers.1.mlp.up_proj.weight", "F32", (8, 8), "b.safetensors"),
        Tensor("language_model.lm_head.weight", "F32", (16, 8), "b.safetensors"),
        Tensor("vision_tower.blocks.0.attn.qkv.weight", "F32", (100, 8), "v.safetensors"),
        Tensor("multi_modal_projector.linear.weight", "F32", (10, 8), "v.safetensors"),
    )
    vision_meta = ModelMetadata("vlm", config, tensors, {"a.safetensors": 1, "b.safetensors": 1, "v.safetensors": 1})
    costs = model_costs(vision_meta)
    assert costs.vision_bytes == (100 + 10) * 8 * 4 and costs.vision_files == {"v.safetensors"}
    plan = make_plan(vision_meta, hosts(2), split=[1, 1])
    last, first = plan.ranks  # rank 1 runs layer 0
    assert first.start == 0 and "v.safetensors" in first.files and "v.safetensors" not in last.files
    assert first.weight_bytes - last.weight_bytes == costs.vision_bytes
    assert any("vision tower" in note for note in plan.notes)
