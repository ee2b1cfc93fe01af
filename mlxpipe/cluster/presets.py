"""Presets in ``configs/*.yaml``: a model, a split and generation defaults.

Precedence: a command-line flag, then the preset, then the defaults (``mlxpipe.defaults``, ``Request``'s).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml

from mlxpipe.errors import ConfigError
from mlxpipe.protocol.request import RequestError, check_fields

T = TypeVar("T")


@dataclass(frozen=True)
class Preset:
    """Everything a preset may set; None means 'not set here'."""

    model: str | None = None
    revision: str | None = None
    strategy: str | None = None
    split: tuple[int, ...] | None = None
    tp: int | None = None  # ranks per tensor-parallel group (``--tp``)
    backend: str | None = None
    max_tokens: int | None = None
    temp: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    system_prompt: str | None = None
    description: str | None = None


_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "revision": (str,), "strategy": (str,), "backend": (str,),
    "max_tokens": (int,), "temp": (int, float), "top_p": (int, float), "min_p": (int, float),
    "seed": (int,), "system_prompt": (str,), "description": (str,), "split": (list,), "tp": (int,),
}


def load_preset(path: str | Path | None) -> Preset:
    """Read and validate a preset; no path gives the empty preset."""
    if path is None:
        return Preset()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config", "see configs/ for examples") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read config ({str(e).splitlines()[0]})") from None
    if data is None:
        return Preset()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    # Generation defaults may be grouped under 'generate:'.
    flat = {k: v for k, v in data.items() if k != "generate"}
    nested = data.get("generate") or {}
    if not isinstance(nested, dict):
        raise ConfigError(f"{path}: 'generate' must be a mapping")
    flat.update(nested)
    known = {f.name for f in fields(Preset)}
    values: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}", f"known keys: {', '.join(sorted(known))}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, _TYPES[key]):
            raise ConfigError(f"{path}: key {key!r} must be {_TYPES[key][0].__name__}, got {value!r}")
        values[key] = value
    try:  # a value out of range is the file's fault: say so, rather than blame a flag that was not given
        values.update(check_fields(values, lambda key: f"{path}: key {key!r}"))
    except RequestError as e:
        raise ConfigError(e.message) from None
    if "split" in values:
        split = values["split"]
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in split):
            raise ConfigError(f"{path}: key 'split' must be a list of layer counts")
        values["split"] = tuple(split)
    return Preset(**values)


@overload
def pick(flag: T | None, preset_value: T | None) -> T | None: ...
@overload
def pick(flag: T | None, preset_value: T | None, default: T) -> T: ...
def pick(flag: T | None, preset_value: T | None, default: T | None = None) -> T | None:
    """Flag, then preset, then default."""
    if flag is not None:
        return flag
    if preset_value is not None:
        return preset_value
    return default
