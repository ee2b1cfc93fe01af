"""plan/model_work.py: what one token costs each layer, from the model's metadata alone."""

from __future__ import annotations

from fixtures.plan_inputs import meta
from mlxpipe.model.metadata import Tensor
from mlxpipe.plan.model_work import model_work


def _t(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> Tensor:
    return Tensor(name, dtype, shape, "w.safetensors")


def test_model_work_counts_two_flops_per_weight_a_token_uses() -> None:
    tensors = [_t(f"model.layers.{i}.mlp.down_proj.weight", (64, 32)) for i in range(2)]
    tensors += [_t("model.layers.0.input_layernorm.weight", (64,)), _t("lm_head.weight", (100, 64)),
                _t("model.embed_tokens.weight", (100, 64))]
    w = model_work(meta(tensors, 2, hidden_size=64, vocab_size=100))
    assert w.layer_flops == (2 * 64 * 32, 2 * 64 * 32)  # the norm is no matrix product
    assert w.head_flops == 2 * 100 * 64
    assert w.attention_flops == (4 * 4 * 16,) * 2  # 4 heads of 16: QK^T and AV
    assert (w.hidden, w.vocab, w.activation_bytes) == (64, 100, 2)


def test_model_work_unpacks_quantized_weights_and_counts_routed_experts_at_their_share() -> None:
    tensors = [_t("model.layers.0.mlp.down_proj.weight", (64, 4), "U32"),  # 4-bit: 8 weights per uint32
               _t("model.layers.0.mlp.down_proj.scales", (64, 1)),
               _t("model.layers.1.mlp.switch_mlp.down_proj.weight", (8, 64, 32))]
    w = model_work(meta(tensors, 2, quantization={"bits": 4, "group_size": 32}, num_experts_per_tok=2,
                        n_routed_experts=8))
    assert w.layer_flops[0] == 2 * 64 * 32
    assert w.layer_flops[1] == 2 * 8 * 64 * 32 * 2 // 8


def test_a_tied_model_s_head_is_its_embedding() -> None:
    w = model_work(meta([_t("model.layers.0.mlp.w.weight", (8, 8)), _t("model.embed_tokens.weight", (50, 8))], 1))
    assert w.head_flops == 2 * 50 * 8 and w.head_bytes == 50 * 8 * 2
