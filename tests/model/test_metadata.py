"""Model metadata from a real local checkpoint (written by MLX), and the checks before planning."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxpipe.errors import ModelError
from mlxpipe.model.metadata import ModelMetadata, Tensor, check_repo_filename, load_local, validate

LLAMA = {
    "model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "bfloat16",
}


def write_checkpoint(
    directory: Path, shards: dict[str, dict[str, mx.array]], config: dict[str, Any] | None = None, index: bool = True
) -> Path:
    """A checkpoint as mlx-lm writes one: safetensors shards, their index and config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA if config is None else config))
    for name, arrays in shards.items():
        mx.save_safetensors(str(directory / name), arrays, metadata={"format": "mlx"})
    if index:
        weight_map = {t: name for name, arrays in shards.items() for t in arrays}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def layer(i: int) -> dict[str, mx.array]:
    return {
        f"model.layers.{i}.self_attn.q_proj.weight": mx.zeros((64, 8), dtype=mx.uint32),
        f"model.layers.{i}.self_attn.q_proj.scales": mx.zeros((64, 1), dtype=mx.bfloat16),
        f"model.layers.{i}.mlp.down_proj.weight": mx.zeros((64, 128), dtype=mx.float16),
        f"model.layers.{i}.input_layernorm.weight": mx.ones((64,), dtype=mx.float32),
    }


SHARDS = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": mx.zeros((100, 64), dtype=mx.bfloat16), **layer(0), **layer(1),
    },
    "model-00002-of-00002.safetensors": {
        **layer(2), "model.norm.weight": mx.ones((64,), dtype=mx.float32),
        "lm_head.weight": mx.zeros((100, 8), dtype=mx.uint32), "model.rope.mask": mx.zeros((3,), dtype=mx.bool_),
        "model.layers.2.extra": mx.zeros((2, 3, 4), dtype=mx.int8),
    },
}

DTYPE_NAMES = {
    mx.uint32: "U32", mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.bool_: "BOOL", mx.int8: "I8",
}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = write_checkpoint(tmp_path / "model", SHARDS)
    (directory / "tokenizer.json").write_text("{}")
    (directory / "README.md").write_text("# a model\n")
    return directory


def test_reads_a_sharded_checkpoint(checkpoint: Path) -> None:
    meta = load_local(checkpoint)
    expected = {
        Tensor(name, DTYPE_NAMES[a.dtype], tuple(a.shape), file)
        for file, arrays in SHARDS.items()
        for name, a in arrays.items()
    }
    assert set(meta.tensors) == expected
    assert len(meta.tensors) == 17
    nbytes = {name: a.nbytes for arrays in SHARDS.values() for name, a in arrays.items()}
    assert {t.name: t.nbytes for t in meta.tensors} == nbytes
    assert meta.file_sizes == {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    assert meta.support_files == ("config.json", "model.safetensors.index.json", "tokenizer.json")
    assert meta.weight_files == tuple(SHARDS)
    assert (meta.source, meta.local, meta.config, meta.commit) == (str(checkpoint), True, LLAMA, None)
    assert (meta.model_type, meta.num_layers) == ("llama", 3)
    validate(meta)


def test_single_file_checkpoint(tmp_path: Path) -> None:
    arrays = {"model.embed_tokens.weight": mx.zeros((10, 4), dtype=mx.float32), **layer(0), **layer(1), **layer(2)}
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": arrays}, index=False)
    meta = load_local(directory)
    assert set(meta.tensors) == {
        Tensor(n, DTYPE_NAMES[a.dtype], tuple(a.shape), "model.safetensors") for n, a in arrays.items()
    }
    assert meta.support_files == ("config.json",)
    validate(meta)


def test_index_wins_over_a_stray_single_file(checkpoint: Path) -> None:
    mx.save_safetensors(str(checkpoint / "model.safetensors"), {"stray": mx.zeros((1,))})
    assert "model.safetensors" not in load_local(checkpoint).weight_files


def test_metadata_json_round_trip(checkpoint: Path) -> None:
    meta = load_local(checkpoint)
    assert ModelMetadata.from_json(json.loads(json.dumps(meta.to_json()))) == meta


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "/abs/x.safetensors", "a\\b.safetensors", "sub/../../x.safetensors", "~/x.safetensors",
             "C:x.safetensors", "./x.safetensors", "a//b.safetensors", ""],
)
def test_index_names_escaping_the_repo_are_refused(tmp_path: Path, name: str) -> None:
    shard = "model-00001-of-00001.safetensors"
    directory = write_checkpoint(tmp_path / "m", {shard: layer(0)}, {**LLAMA, "num_hidden_layers": 1})
    (tmp_path / "x.safetensors").write_bytes(b"")  # what "../x" would reach
    weight_map = {"model.layers.0.self_attn.q_proj.weight": shard, "model.norm.weight": name}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError) as e:
        load_local(directory)
    assert str(e.value) == f"{directory}: the weight index names the file {name!r}, which escapes the model directory"
    assert e.value.hint == "the checkpoint's index is malformed or malicious; nothing was fetched"


@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors", "sub/dir/model.safetensors", "a..b.safetensors"])
def test_plain_file_names_are_accepted(name: str) -> None:
    check_repo_filename(name, "repo")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "neither model.safetensors.index.json nor model.safetensors found"),
        ({"model.safetensors.index.json": "{}"}, "model.safetensors.index.json has no 'weight_map'"),
        ({"model.safetensors.index.json": '{"weight_map": {}}'}, "model.safetensors.index.json has no 'weight_map'"),
        ({"model.safetensors.index.json": '{"weight_map": {"a": "w1.safetensors"}}'},
         "the weight index names w1.safetensors, which is missing"),
        ({"model.safetensors.index.json": "{"}, "cannot read model.safetensors.index.json "
         "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ({"model.safetensors.index.json": "[]"}, "model.safetensors.index.json is not a JSON object"),
        ({"model.safetensors": b"\x01\x00"}, "not a safetensors file (too short)"),
        ({"model.safetensors": struct.pack("<Q", 1 << 40) + b"{}"},
         "not a safetensors file (header of 1099511627776 bytes)"),
    ],
    ids=["no-weights", "index-no-map", "index-empty-map", "index-missing-file", "index-bad-json", "index-not-object",
         "short-file", "huge-header"],
)
def test_unreadable_checkpoints(tmp_path: Path, files: dict[str, str | bytes], message: str) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    for name, content in files.items():
        path = directory / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ModelError) as e:
        load_local(directory)
    prefix = f"{directory / 'model.safetensors'}: " if "safetensors file" in message else f"{directory}: "
    assert str(e.value) == prefix + message


def test_unreadable_header(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ModelError) as e:
        load_local(directory)
    assert str(e.value) == (
        "model.safetensors: unreadable safetensors header "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    )


@pytest.mark.parametrize(("config", "message"), [(None, "no config.json"), ("[]", "config.json is not a JSON object")])
def test_config_errors(tmp_path: Path, config: str | None, message: str) -> None:
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": layer(0)}, index=False)
    if config is None:
        (directory / "config.json").unlink()
    else:
        (directory / "config.json").write_text(config)
    with pytest.raises(ModelError) as e:
        load_local(directory)
    assert str(e.value) == f"{directory}: {message}"


# --- validate: refuse what mlx-lm cannot pipeline -------------------------------------------


def _validate(tmp_path: Path, config: dict[str, Any], layers: list[int]) -> tuple[Path, ModelError]:
    arrays = {"model.embed_tokens.weight": mx.zeros((4, 4))}
    for i in layers:
        arrays.update(layer(i))
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": arrays}, config, index=False)
    with pytest.raises(ModelError) as e:
        validate(load_local(directory))
    return directory, e.value


def test_unknown_model_type(tmp_path: Path) -> None:
    directory, error = _validate(tmp_path, {**LLAMA, "model_type": "not_a_model"}, [0, 1, 2])
    assert str(error) == f"{directory}: model_type 'not_a_model' is not supported by the installed mlx-lm"
    assert error.hint == "upgrade mlx-lm (pip install -U mlx-lm) or pick a supported model"


def test_no_model_type(tmp_path: Path) -> None:
    config = {k: v for k, v in LLAMA.items() if k != "model_type"}
    directory, error = _validate(tmp_path, config, [0, 1, 2])
    assert str(error) == f"{directory}: config.json has no 'model_type'"


@pytest.mark.parametrize("value", [0, -1, "32", 2.0, True])
def test_num_hidden_layers_invalid(tmp_path: Path, value: Any) -> None:
    directory, error = _validate(tmp_path, {**LLAMA, "num_hidden_layers": value}, [0, 1, 2])
    assert str(error) == f"{directory}: config.json's 'num_hidden_layers' is {value!r}, not a positive number of layers"
    assert error.hint == "fix config.json, or download the model again"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("n_layer", 3, 3),
        ("num_layers", 3, 3),
        ("n_layers", 3, 3),
        ("num_transformer_layers", 3, 3),
        ("hybrid_override_pattern", "M*-", 3),
        ("layers_block_type", ["mamba", "attention", "mamba"], 3),
        (None, None, 3),  # no count in the config: the checkpoint's numbered blocks
    ],
)
def test_layer_count_under_any_key(tmp_path: Path, key: str | None, value: Any, expected: int) -> None:
    config = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    if key is not None:
        config[key] = value
    weights = {"model.safetensors": {**layer(0), **layer(1), **layer(2)}}
    directory = write_checkpoint(tmp_path / "m", weights, config, False)
    meta = load_local(directory)
    validate(meta)
    assert meta.num_layers == expected


def test_no_layer_count_and_no_numbered_blocks(tmp_path: Path) -> None:
    config = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    directory, error = _validate(tmp_path, config, [])
    assert str(error).startswith(f"{directory}: cannot tell how many layers the model has")


def test_no_layers(tmp_path: Path) -> None:
    directory, error = _validate(tmp_path, LLAMA, [])
    assert str(error) == f"{directory}: no tensor belongs to a numbered block ('layers.N', 'h.N', ...)"
    assert error.hint == "mlxpipe pipelines models whose blocks are a numbered list"


@pytest.mark.parametrize(
    ("num_layers", "present", "missing"),
    [(3, [0, 2], "1"), (6, [3, 4], "0-2, 5"), (8, [0, 2, 4, 6], "1, 3, 5, 7"), (4, [4, 5], "0-3")],
)
def test_missing_layers(tmp_path: Path, num_layers: int, present: list[int], missing: str) -> None:
    directory, error = _validate(tmp_path, {**LLAMA, "num_hidden_layers": num_layers}, present)
    assert str(error) == f"{directory}: the checkpoint has no weights for layers {missing} of {num_layers}"
    assert error.hint == "convert the model with mlx_lm.convert first"


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "deepseek_v3", "kimi_k2"])
def test_known_and_remapped_model_types_validate(tmp_path: Path, model_type: str) -> None:
    arrays = {**layer(0), **layer(1), **layer(2), **layer(3)}  # layer 3 past num_hidden_layers: an MTP layer
    config = {**LLAMA, "model_type": model_type}
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": arrays}, config, index=False)
    validate(load_local(directory))


def test_nested_text_config_validates(tmp_path: Path) -> None:
    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2}}
    arrays = {f"language_model.{k}": v for k, v in {**layer(0), **layer(1)}.items()}
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": arrays}, config, False)
    meta = load_local(directory)
    validate(meta)
    assert (meta.model_type, meta.num_layers) == ("gemma3", 2)


@pytest.mark.parametrize(
    ("model_type", "text_model_type", "module"),
    [
        ("qwen3_5", "qwen3_5_text", "qwen3_5"),
        ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_moe"),
        ("qwen3_vl", "qwen3_vl_text", "qwen3_vl"),
        ("qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_moe"),
        ("qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl"),  # remapped by mlx-lm
    ],
)
def test_model_type_is_the_top_level_one_as_mlx_lm_loads_it(
    tmp_path: Path, model_type: str, text_model_type: str, module: str
) -> None:
    # Published multimodal checkpoints nest a text_config whose model_type names no mlx-lm module.
    config = {"model_type": model_type, "text_config": {**LLAMA, "model_type": text_model_type}}
    arrays = {f"language_model.model.{k}": v for k, v in {**layer(0), **layer(1), **layer(2)}.items()}
    directory = write_checkpoint(tmp_path / "m", {"model.safetensors": arrays}, config, False)
    meta = load_local(directory)
    validate(meta)
    assert (meta.model_type, meta.mlx_lm_module, meta.num_layers) == (model_type, module, 3)


def test_architecture_remapping_is_honoured(tmp_path: Path) -> None:
    config = {**LLAMA, "model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]}
    weights = {"model.safetensors": {**layer(0), **layer(1), **layer(2)}}
    directory = write_checkpoint(tmp_path / "m", weights, config, False)
    assert load_local(directory).mlx_lm_module == "bailing_moe_v3"
