"""model/gguf.py: GGUF tensor names as mlx-lm's, and the ones that do not convert refused. (The whole conversion is
checked on the demo model it builds: tests/model/test_demo.py.)"""

from __future__ import annotations

import pytest

from mlxpipe.errors import ModelError
from mlxpipe.model.gguf import mlx_name


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("blk.7.attn_q.scales", "model.layers.7.self_attn.q_proj.scales"),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
        ("blk.12.ffn_gate.biases", "model.layers.12.mlp.gate_proj.biases"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ],
)
def test_mlx_name(gguf: str, mlx: str) -> None:
    assert mlx_name(gguf) == mlx


@pytest.mark.parametrize(
    "gguf", ["output.weight", "blk.0.attn_qkv.weight", "rope_freqs.weight"]
)
def test_mlx_name_rejects_unknown(gguf: str) -> None:
    with pytest.raises(ModelError):
        mlx_name(gguf)
