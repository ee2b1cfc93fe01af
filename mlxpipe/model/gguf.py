"""A Llama GGUF file read as an mlx-lm checkpoint: its tensors under mlx-lm's names, its ``config.json``, and its
byte-level BPE vocabulary as a ``tokenizers`` tokenizer with its ``tokenizer_config.json``.

``mx.load`` already reads GGUF Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized weights (group size
32), so the conversion renames tensors, widens scales to float32 and rebuilds the config and
tokenizer from the GGUF metadata. Only what the demo model needs converts (tied-embedding Llama,
byte-level BPE); anything else is refused by name.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, cast

from mlxpipe.errors import ModelError

# Every GGUF quantization mx.load maps to MLX (Q4_0, Q4_1, Q8_0) uses blocks of 32.
_GGUF_BLOCK = 32

_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|scales|biases)$")

# llama.cpp pre-tokenizer names whose regex splits digits one by one before the
# GPT-2 regex (llama-vocab.cpp groups smollm with starcoder and refact).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_PLAIN_GPT2_PRE = {"gpt2", "default"}
_TOKEN_TYPE_CONTROL = 3


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors and metadata of a GGUF file, or ModelError if it is not one."""
    import mlx.core as mx

    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelError(f"cannot read {path} as a GGUF file: {exc}") from exc
    weights, metadata = cast(tuple[dict[str, Any], dict[str, Any]], loaded)  # with return_metadata: a pair
    if not isinstance(metadata, dict) or "general.architecture" not in metadata:
        raise ModelError(f"{path} is not a GGUF file (no general.architecture)")
    return weights, metadata


def convert_tensors(weights: dict[str, Any]) -> dict[str, Any]:
    """Rename GGUF tensors to mlx-lm Llama names and widen float tensors to float32."""
    import mlx.core as mx

    out = {}
    for name, array in weights.items():
        # float16 scales, biases and norms run ~25x slower than float32 on CPU.
        if mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(mx.float32)
        out[mlx_name(name)] = array
    return out


def mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    if match := _LAYER_RE.match(gguf_name):
        layer, module, kind = match.groups()
        if module in _LAYER_MODULES:
            return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{kind}"
    elif match := _TOP_RE.match(gguf_name):
        module, kind = match.groups()
        if module in _TOP_MODULES:
            return f"{_TOP_MODULES[module]}.{kind}"
    raise ModelError(
        f"unsupported GGUF tensor {gguf_name!r} (only tied-embedding Llama converts)"
    )


def quantization(tensors: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's ``quantization`` config: the common bit width plus exceptions."""
    bits = {name: _module_bits(tensors, name) for name in _matrix_modules(tensors)}
    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": _GGUF_BLOCK, "bits": default}
    for module, width in sorted(bits.items()):
        if width != default:
            config[module] = {"group_size": _GGUF_BLOCK, "bits": width}
    return config


def _matrix_modules(tensors: dict[str, Any]) -> list[str]:
    """Modules whose weight is a matrix (everything but the norms)."""
    return [
        name[: -len(".weight")]
        for name, a in tensors.items()
        if name.endswith(".weight") and a.ndim == 2
    ]


def _module_bits(tensors: dict[str, Any], module: str) -> int:
    """Bit width of a quantized module: 32 b-bit values pack into b uint32 words."""
    scales = tensors.get(f"{module}.scales")
    if scales is None:
        dtype = tensors[f"{module}.weight"].dtype
        raise ModelError(
            f"{module} is stored as {dtype}; only Q4_0, Q4_1 and Q8_0 tensors convert"
        )
    group: int = tensors[f"{module}.weight"].shape[-1] // scales.shape[-1]
    return group


def model_config(metadata: dict[str, Any], quant: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm ``config.json`` for a Llama GGUF, hyperparameters from its metadata."""
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise ModelError(
            f"unsupported GGUF architecture {arch!r} (only llama converts)"
        )
    hidden = _meta(metadata, "llama.embedding_length")
    heads = _meta(metadata, "llama.attention.head_count")
    head_dim = hidden // heads
    rope_dim = metadata.get("llama.rope.dimension_count")
    if rope_dim is not None and _scalar(rope_dim) != head_dim:
        raise ModelError(
            f"partial RoPE ({_scalar(rope_dim)} of {head_dim} dims) is not supported"
        )
    tokens = _meta(metadata, "tokenizer.ggml.tokens")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": _meta(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _meta(metadata, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(
            metadata, "llama.attention.head_count_kv", heads
        ),
        "head_dim": head_dim,
        # GGUF stores float32: 1e-5 reads back as 9.99999974e-06.
        "rms_norm_eps": float(
            f"{_meta(metadata, 'llama.attention.layer_norm_rms_epsilon'):.7g}"
        ),
        "rope_theta": float(
            f"{_scalar(metadata.get('llama.rope.freq_base', 10000.0)):.7g}"
        ),
        # llama.cpp permutes Q and K rows for interleaved (GPT-J style) RoPE.
        "rope_traditional": True,
        "vocab_size": _meta_int(metadata, "llama.vocab_size", len(tokens)),
        "max_position_embeddings": _meta(metadata, "llama.context_length"),
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": _meta(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(metadata, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "quantization": quant,
        "quantization_config": quant,
    }


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """The GGUF byte-level BPE vocabulary as a ``tokenizers.Tokenizer``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    if (kind := _meta(metadata, "tokenizer.ggml.model")) != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer {kind!r} (only byte-level BPE converts)"
        )
    tokens = _meta(metadata, "tokenizer.ggml.tokens")
    merges = [
        tuple(merge.split(" ", 1)) for merge in _meta(metadata, "tokenizer.ggml.merges")
    ]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(
        str(metadata.get("tokenizer.ggml.pre", "default")), pre_tokenizers
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in _control_token_ids(metadata)
    ]
    tokenizer.add_special_tokens(specials)
    return tokenizer


def _pre_tokenizer(pre: str, pre_tokenizers: Any) -> Any:
    """The HF pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PLAIN_GPT2_PRE:
        return byte_level
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    raise ModelError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _control_token_ids(metadata: dict[str, Any]) -> list[int]:
    """Ids whose GGUF token type is 'control' (chat markers, end of text)."""
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return []
    return [i for i, kind in enumerate(types.tolist()) if kind == _TOKEN_TYPE_CONTROL]


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens and the GGUF chat template."""
    tokens = _meta(metadata, "tokenizer.ggml.tokens")
    eos = _meta(metadata, "tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        # Named so transformers does not pick one from config.json's model_type (a
        # Llama tokenizer adds BOS); the generic class uses tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[_meta(metadata, "tokenizer.ggml.bos_token_id")],
        "eos_token": tokens[eos],
        "pad_token": tokens[
            _meta_int(metadata, "tokenizer.ggml.padding_token_id", eos)
        ],
        "add_bos_token": bool(
            _scalar(metadata.get("tokenizer.ggml.add_bos_token", False))
        ),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _meta(metadata, "llama.context_length"),
    }
    if (unk := metadata.get("tokenizer.ggml.unknown_token_id")) is not None:
        config["unk_token"] = tokens[_scalar(unk)]
    if (template := metadata.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def _meta(metadata: dict[str, Any], key: str) -> Any:
    """A required GGUF metadata value as a Python value."""
    if key not in metadata:
        raise ModelError(f"GGUF metadata lacks {key}")
    return _scalar(metadata[key])


def _meta_int(metadata: dict[str, Any], key: str, default: int) -> int:
    """An optional integer GGUF metadata value."""
    value = metadata.get(key)
    return default if value is None else int(_scalar(value))


def _scalar(value: Any) -> Any:
    """mx.load returns numeric metadata as 0-d arrays; unwrap them."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value
