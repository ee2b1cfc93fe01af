"""What a model's config says about it: layer count, the text config, layers that share a KV cache,
sliding windows, and which mlx-lm module runs it (read from mlx-lm's sources, without importing it).

Pure over ``config.json``'s dict: no weights, no MLX.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from mlxpipe.errors import ModelError

# Where architectures keep their layer count, in mlx-lm's ModelArgs spellings.
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_transformer_layers")
# Per-layer lists that describe the whole stack (one entry per block).
LAYER_PATTERN_KEYS = (
    "hybrid_override_pattern", "layers_block_type", "block_types", "block_configs", "layer_types",
)
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
CONFIG_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def config_layer_count(config: dict[str, Any], source: str) -> int | None:
    """The layer count ``config`` states (any spelling, or a per-layer pattern); None if none."""
    for key in LAYER_COUNT_KEYS:
        if key in config and config[key] is not None:
            n = config[key]
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ModelError(
                    f"{source}: config.json's {key!r} is {n!r}, not a positive number of layers",
                    "fix config.json, or download the model again",
                )
            return n
    for key in LAYER_PATTERN_KEYS:
        pattern = config.get(key)
        if isinstance(pattern, (str, list)) and pattern:
            return len(pattern)
    return None


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of ``config`` (nested as ``text_config`` in multimodal models)."""
    nested = config.get("text_config")
    if isinstance(nested, dict) and not _has_layer_count(config):
        return nested
    return config


def kv_sharing_groups(config: dict[str, Any]) -> list[tuple[int, int]]:
    """Layer ranges ``(first, last)`` that must run on one rank.

    KV-sharing layers (``num_kv_shared_layers``: Gemma 3n, Gemma 4) read, in the
    same forward pass, the cache of the last earlier layer of their type; the
    readers, their sources and every layer between stay together.
    """
    reuse = config.get("num_kv_reuse_layers")
    n = config_layer_count(config, "config.json") or 0
    if isinstance(reuse, int) and 0 < reuse < n:
        # AFM: the KV-reuse layers, run last, read the cache of the layer before them.
        return [(n - reuse - 1, n - 1)]
    shared = config.get("num_kv_shared_layers")
    if not isinstance(shared, int) or shared <= 0:
        return []
    types = _layer_types(config)
    first_shared = len(types) - shared
    if not types or first_shared <= 0:
        return [(0, len(types) - 1)] if types else []
    sources = [
        max((i for i in range(first_shared) if types[i] == kind), default=0)
        for kind in set(types[first_shared:])
    ]
    return [(min(sources), len(types) - 1)]


def _layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's attention kind: ``layer_types``, else Gemma's sliding-window pattern."""
    types = config.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    n = config_layer_count(config, "config.json") or 0
    every = config.get("sliding_window_pattern")
    if not isinstance(every, int) or every <= 0:
        return ["full_attention"] * n
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


def _has_layer_count(config: dict[str, Any]) -> bool:
    return any(config.get(k) is not None for k in LAYER_COUNT_KEYS + LAYER_PATTERN_KEYS)


def resolve_model_type(model_type: str, architectures: Any = None) -> str:
    """The mlx-lm module for ``model_type``, resolved exactly as mlx-lm's ``_get_classes`` does."""
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_architecture = _mlx_lm_constant("MODEL_ARCHITECTURE_REMAPPING")
    for architecture in architectures or ():
        remapped = by_architecture.get((model_type, architecture))
        if remapped is not None:
            return remapped
    return _mlx_lm_constant("MODEL_REMAPPING").get(model_type, model_type)


@lru_cache(maxsize=1)
def mlx_lm_model_types() -> frozenset[str]:
    """The model types the installed mlx-lm implements, found without importing it."""
    models = _mlx_lm_dir() / "models"
    return frozenset(p.stem for p in models.glob("*.py") if not p.stem.startswith("_"))


@cache
def _mlx_lm_constant(name: str) -> dict[Any, str]:
    """A remapping table of mlx_lm/utils.py, read from its source: importing it would import mlx."""
    tree = ast.parse((_mlx_lm_dir() / "utils.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            table: dict[Any, str] = ast.literal_eval(node.value)
            return table
    return {}


def _mlx_lm_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("mlx-lm is not installed", "pip install mlx-lm")
    return Path(next(iter(spec.submodule_search_locations)))


def layer_windows(c: dict[str, Any], n: int) -> list[int | None]:
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if not window:
        return [None] * n
    if isinstance(types, list) and len(types) >= n:
        return [window if "sliding" in str(t) else None for t in types[:n]]
    pattern = c.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return [None if i % pattern == pattern - 1 else window for i in range(n)]
    if c.get("model_type") == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n)]
    return [None] * n
