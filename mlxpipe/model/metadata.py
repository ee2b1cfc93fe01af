"""What a model is made of, read from its metadata alone (no weights).

``config.json``, ``model.safetensors.index.json`` and the safetensors headers
give every tensor's dtype and shape, so the exact bytes of every layer, without
downloading a single weight. Hub access lives in ``mlxpipe.hub.client``, what a
config says about the model (layer count, KV cache, mlx-lm's module) in
``mlxpipe.model.facts``; this module holds the data types and local-directory reading.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mlxpipe.errors import ModelError
from mlxpipe.model.facts import (
    CONFIG_DTYPE_BYTES,
    DTYPE_BYTES,
    LAYER_COUNT_KEYS,
    config_layer_count,
    layer_windows,
    mlx_lm_model_types,
    resolve_model_type,
    text_config_of,
)

WEIGHT_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
# What a rank needs besides its weights; the same patterns mlx-lm's sharded_load uses.
SUPPORT_PATTERNS = (
    "*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja",
)
# A numbered entry of a module list: "<prefix>.<N>.<rest>". Tensors are matched to
# layers by their block number, as mlx-lm does, since sanitize can rename the rest.
_NUMBERED_RE = re.compile(r"^(.*?)\.(\d+)\.")
_HEADER_LIMIT = 100 * 1024 * 1024


@dataclass(frozen=True)
class Tensor:
    """One tensor of the checkpoint, as its safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)



@dataclass(frozen=True)
class ModelMetadata:
    """A checkpoint described without its weights."""

    source: str  # a hub repo id or a local directory
    config: dict[str, Any]
    tensors: tuple[Tensor, ...]
    file_sizes: dict[str, int]  # every file of the checkpoint -> bytes
    revision: str | None = None
    commit: str | None = None
    local: bool = False
    support_files: tuple[str, ...] = field(default=())
    file_sha256: dict[str, str] = field(default_factory=dict)  # LFS files: the hub's sha256

    @property
    def model_type(self) -> str:
        """The ``model_type`` mlx-lm loads the checkpoint by: the top-level one, as ``_get_classes`` reads it.

        Multimodal wrappers (``qwen3_5``, ``qwen3_vl``, ``gemma3``) nest a ``text_config``
        whose own ``model_type`` (``qwen3_5_text``...) often names no mlx-lm module.
        """
        return str(self.config.get("model_type") or self.text_config.get("model_type") or "")

    @property
    def mlx_lm_module(self) -> str:
        """The ``mlx_lm.models`` module that implements the checkpoint (remappings applied)."""
        return resolve_model_type(self.model_type, self.config.get("architectures"))

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (nested as ``text_config`` in multimodal models)."""
        return text_config_of(self.config)

    @cached_property
    def num_layers(self) -> int:
        """The number of blocks: the config's count under any of its spellings, else its
        per-layer pattern's length, else the checkpoint's numbered blocks."""
        for config in (self.text_config, self.config):
            n = config_layer_count(config, self.source)
            if n is not None:
                return n
        if self.block_prefix is not None:
            return len(self._block_numbers[self.block_prefix])
        raise ModelError(
            f"{self.source}: cannot tell how many layers the model has: config.json has none of "
            f"{', '.join(LAYER_COUNT_KEYS)} and no tensor belongs to a numbered block",
            "mlxpipe pipelines models whose blocks are a numbered list ('layers.N', 'h.N', ...)",
        )

    @cached_property
    def _block_numbers(self) -> dict[str, set[int]]:
        """Every "<prefix>.<N>." list in the tensor names, outside other numbered lists: prefix -> Ns."""
        found: dict[str, set[int]] = {}
        for t in self.tensors:
            m = _NUMBERED_RE.match(t.name)
            if m:
                found.setdefault(m.group(1), set()).add(int(m.group(2)))
        # "model.layers.0.mlp.experts" is a list inside a block, never the block list.
        return {p: ns for p, ns in found.items() if not re.search(r"(^|\.)\d+(\.|$)", p)}

    @cached_property
    def block_prefix(self) -> str | None:
        """The tensor-name prefix of the block list ("model.layers", "transformer.h"...).

        One rule for every architecture: among the numbered lists that sit in no
        other numbered list, the one whose numbering best covers the layer count
        the config gives (layers past it are MTP blocks sanitize drops), else the
        longest; then the heaviest (a language model outweighs a vision tower of
        as many blocks), then the shallowest.
        """
        lists = self._block_numbers
        if not lists:
            return None
        n = next((c for c in (config_layer_count(self.text_config, self.source),
                              config_layer_count(self.config, self.source)) if c), None)

        def score(prefix: str) -> tuple[int, int, int, str]:
            numbers = lists[prefix]
            covered = len(numbers & set(range(n))) if n else len(numbers)
            return (-covered, -self._list_bytes[prefix], prefix.count("."), prefix)

        return min(lists, key=score)

    @cached_property
    def _list_bytes(self) -> dict[str, int]:
        """Bytes of the tensors under each numbered list of ``_block_numbers``."""
        out = dict.fromkeys(self._block_numbers, 0)
        for t in self.tensors:
            m = _NUMBERED_RE.match(t.name)
            if m and m.group(1) in out:
                out[m.group(1)] += t.nbytes
        return out

    @cached_property
    def _layer_index(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for prefix, first in self._block_lists:
            head = prefix + "."
            for t in self.tensors:
                if t.name.startswith(head):
                    number = t.name[len(head):].split(".", 1)[0]
                    if number.isdigit():
                        out[t.name] = first + int(number)
        return out

    @cached_property
    def _block_lists(self) -> list[tuple[str, int]]:
        """The block list and the number of its first block; then, when the config counts
        more layers than it holds, the one list beside it that makes up the rest
        (AFM's ``kv_reuse_layers``, run after ``layers``), numbered on."""
        prefix = self.block_prefix
        if prefix is None:
            return []
        lists = [(prefix, 0)]
        n = config_layer_count(self.text_config, self.source) or 0
        held = len(self._block_numbers[prefix])
        parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        siblings = [
            p for p, numbers in self._block_numbers.items()
            if p != prefix and (p.rsplit(".", 1)[0] if "." in p else "") == parent
            and held + len(numbers) == n
        ]
        if held < n and len(siblings) == 1:
            lists.append((siblings[0], held))
        return lists

    def layer_of(self, tensor: Tensor) -> int | None:
        """The block number ``tensor`` belongs to, or None for shared tensors (embeddings, head)."""
        return self._layer_index.get(tensor.name)

    @property
    def weight_files(self) -> tuple[str, ...]:
        return tuple(sorted({t.file for t in self.tensors}))

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "revision": self.revision,
            "commit": self.commit,
            "local": self.local,
            "config": self.config,
            "file_sizes": self.file_sizes,
            "support_files": list(self.support_files),
            "file_sha256": self.file_sha256,
            "tensors": [[t.name, t.dtype, list(t.shape), t.file] for t in self.tensors],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelMetadata:
        return cls(
            source=data["source"],
            revision=data.get("revision"),
            commit=data.get("commit"),
            local=data.get("local", False),
            config=data["config"],
            file_sizes=data["file_sizes"],
            support_files=tuple(data.get("support_files", ())),
            file_sha256=data.get("file_sha256", {}),
            tensors=tuple(Tensor(n, d, tuple(s), f) for n, d, s, f in data["tensors"]),
        )


def parse_header(raw: bytes, file: str) -> list[Tensor]:
    """The tensors of one safetensors header (the JSON after the 8-byte length)."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{file}: unreadable safetensors header ({e})") from None
    return [
        Tensor(name, info["dtype"], tuple(info["shape"]), file)
        for name, info in header.items()
        if name != "__metadata__"
    ]


def read_local_header(path: Path) -> list[Tensor]:
    """Read a local safetensors file's header without touching its data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT:
            raise ModelError(f"{path}: not a safetensors file (header of {length} bytes)")
        return parse_header(f.read(length), path.name)


def weight_map(index: dict[str, Any], source: str) -> dict[str, str]:
    """The index's tensor -> file map, refusing file names that escape the repo."""
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise ModelError(f"{source}: {WEIGHT_INDEX} has no 'weight_map'")
    for name in set(wm.values()):
        check_repo_filename(name, source)
    return wm


def check_repo_filename(name: Any, source: str) -> None:
    """Refuse a file name that could land outside the model's directory."""
    bad = (
        not isinstance(name, str) or not name or name.startswith(("/", "~")) or "\\" in name
        or "\0" in name or ":" in name or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise ModelError(
            f"{source}: the weight index names the file {name!r}, which escapes the model directory",
            "the checkpoint's index is malformed or malicious; nothing was fetched",
        )


def load_local(directory: Path) -> ModelMetadata:
    """Describe a local checkpoint directory."""
    source = str(directory)
    config = read_json(directory / "config.json", source)
    if (directory / WEIGHT_INDEX).exists():
        wm = weight_map(read_json(directory / WEIGHT_INDEX, source), source)
        files = sorted(set(wm.values()))
    elif (directory / SINGLE_WEIGHTS).exists():
        files = [SINGLE_WEIGHTS]
    else:
        raise ModelError(
            f"{source}: neither {WEIGHT_INDEX} nor {SINGLE_WEIGHTS} found",
            "mlxpipe reads safetensors checkpoints (convert with mlx_lm.convert)",
        )
    tensors: list[Tensor] = []
    for name in files:
        if not (directory / name).exists():
            raise ModelError(f"{source}: the weight index names {name}, which is missing")
        tensors.extend(read_local_header(directory / name))
    sizes = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in directory.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }
    support = tuple(sorted(f for f in sizes if is_support_file(f)))
    return ModelMetadata(source, config, tuple(tensors), sizes, local=True, support_files=support)


def is_support_file(name: str) -> bool:
    """A non-weight file every rank needs (config, tokenizer, custom code)."""
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in SUPPORT_PATTERNS)


def read_json(path: Path, source: str) -> dict[str, Any]:
    """A JSON object from ``path``; errors name ``source`` and the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{source}: no {path.name}", "is this a model directory?") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{source}: cannot read {path.name} ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{source}: {path.name} is not a JSON object")
    return data


def validate(meta: ModelMetadata) -> None:
    """Refuse models mlxpipe cannot pipeline, before anything is launched."""
    model_type = meta.model_type
    if not model_type:
        raise ModelError(f"{meta.source}: config.json has no 'model_type'")
    if meta.mlx_lm_module not in mlx_lm_model_types():
        raise ModelError(
            f"{meta.source}: model_type {model_type!r} is not supported by the installed mlx-lm",
            "upgrade mlx-lm (pip install -U mlx-lm) or pick a supported model",
        )
    n = meta.num_layers
    present = {meta.layer_of(t) for t in meta.tensors} - {None}
    if not present:
        raise ModelError(
            f"{meta.source}: no tensor belongs to a numbered block ('layers.N', 'h.N', ...)",
            "mlxpipe pipelines models whose blocks are a numbered list",
        )
    missing = sorted(set(range(n)) - present)
    if missing:
        raise ModelError(
            f"{meta.source}: the checkpoint has no weights for layers {_ranges(missing)} of {n}",
            "convert the model with mlx_lm.convert first",
        )


def kv_bytes_per_token(meta: ModelMetadata) -> list[tuple[int, int | None]]:
    """Per layer: KV-cache bytes per token of context, and its window (None = unbounded).

    An estimate from the config: full attention stores keys and values for every
    token; MLA stores one latent; sliding-window layers stop growing at the window.
    """
    c = meta.text_config
    width = _activation_bytes(meta)
    heads = c.get("num_attention_heads") or 1
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c.get("hidden_size", 0) // heads)
    if c.get("kv_lora_rank"):
        per_token = (c["kv_lora_rank"] + c.get("qk_rope_head_dim", 0)) * width
    else:
        per_token = 2 * kv_heads * head_dim * width
    windows = layer_windows(c, meta.num_layers)
    return [(per_token, w) for w in windows]


def _activation_bytes(meta: ModelMetadata) -> int:
    c = meta.text_config
    dtype = c.get("torch_dtype") or c.get("dtype") or meta.config.get("torch_dtype")
    if dtype in CONFIG_DTYPE_BYTES:
        return CONFIG_DTYPE_BYTES[dtype]
    # Quantized or untyped checkpoints compute in the dtype of their norms.
    for t in meta.tensors:
        if t.name.endswith("norm.weight"):
            return DTYPE_BYTES.get(t.dtype, 2)
    return 2


def _ranges(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    nums = sorted(numbers)
    start = prev = nums[0]
    for x in [*nums[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if x is not None:
            start = prev = x
    return ", ".join(out)
