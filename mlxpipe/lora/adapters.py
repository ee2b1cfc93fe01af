"""The adapters on this machine, in mlx-lm's format: ``adapter_config.json`` and one ``adapters.safetensors``
merged from every rank's layers (``mlx_lm.generate --adapter-path`` loads them)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlxpipe.lora.options import TrainOptions
from mlxpipe.paths import replacing

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"


def write_adapter_config(options: TrainOptions, model_path: str) -> Path:
    """``adapter_config.json`` as mlx_lm.lora writes it (its keys, sorted), plus the pipeline's options."""
    from mlx_lm.utils import save_config

    path = Path(options.adapter_path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**asdict(options), "model": model_path, "config": None, "report_to": None, "project_name": None,
              "grad_accumulation_steps": 1, "clear_cache_threshold": 0}
    save_config(config, path / CONFIG_FILE)
    return path / CONFIG_FILE


def merge_adapters(parts: dict[int, str]) -> dict[str, Any]:
    """Every rank's adapter tensors (as its ``adapter`` event carries them) in one dict, the first layers first."""
    from mlxpipe.worker.training.train import decode_weights

    merged: dict[str, Any] = {}
    for rank in sorted(parts, reverse=True):  # the highest rank runs the first layers
        merged.update(decode_weights(parts[rank]))
    return merged


def save_adapters(weights: dict[str, Any], path: Path) -> None:
    """``weights`` as one safetensors file, written whole (a crash leaves the old one)."""
    import mlx.core as mx

    with replacing(path, suffix=".tmp.safetensors") as tmp:
        mx.save_safetensors(str(tmp), weights)
