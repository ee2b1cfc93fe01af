"""A prefix's caches as the disk tier's files: a snapshot taken on the rank's thread, bytes written without MLX.

The files are mlx-lm's prompt cache format (``save_prompt_cache``'s layout, read back by ``load_prompt_cache``):
``snapshot`` lays a cache list out as ``save_prompt_cache`` does, every array made contiguous and evaluated on the
rank's thread and its buffer kept, so that the disk tier's writer thread (``disk_cache``) puts those bytes in a
safetensors file without calling MLX (``write_safetensors``), and a file's CRC-32 is checked before it is loaded
(``file_crc``). Only caches whose whole state round-trips through that file are saved (``saveable``).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache

FORMAT = 1  # of the files and of the slice's identity; a new one starts a new folder
_CHUNK = 1 << 22  # bytes read at a time when a file's CRC is checked
# The cache kinds whose whole state round-trips through mlx-lm's file (``from_state`` restores every field
# they read). Others (ArraysCache, ChunkedKVCache, quantized caches) keep fields outside their state.
_SAVEABLE = frozenset({"KVCache", "RotatingKVCache", "ConcatenateKVCache", "CacheList"})
# safetensors' names of MLX's dtypes
_DTYPES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.int8: "I8",
    mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
}


Tokens = np.ndarray  # token ids as little-endian 32-bit ints: compared whole in one call


def as_tokens(tokens: Sequence[int] | Tokens) -> Tokens:
    return np.asarray(tokens, dtype="<u4")


def saveable(cache: Sequence[Any]) -> bool:
    """Whether every cache of ``cache`` round-trips through mlx-lm's prompt cache file."""
    for c in cache:
        if type(c).__name__ not in _SAVEABLE:
            return False
        if type(c).__name__ == "CacheList" and not saveable(c.caches):
            return False
    return True


@dataclass(frozen=True)
class Tensor:
    """One array of a snapshot, as safetensors writes it; ``data`` is the evaluated array's own buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True)
class Snapshot:
    """A prefix's caches, ready to be written by a thread that never calls MLX."""

    tokens: Tokens
    tensors: tuple[Tensor, ...]
    metadata: dict[str, str]
    trimmable: bool

    @property
    def nbytes(self) -> int:
        return sum(t.data.nbytes for t in self.tensors)


def snapshot(tokens: Sequence[int], cache: Sequence[Any]) -> Snapshot:
    """``cache`` (holding exactly ``tokens``) as ``save_prompt_cache`` lays it out, so ``load_prompt_cache``
    reads the file: every array made contiguous and evaluated here, on the rank's thread (a copy only where a
    cache is a view, as a decode group's row), its buffer kept for the writer."""
    scalars: list[Any] = [""]  # as save_prompt_cache: never empty, or tree_flatten drops it
    arrays: dict[str, mx.array] = {}
    flat: Any = tree_flatten([c.state for c in cache])  # (name, leaf) pairs: a list unless asked for a dict
    for name, value in flat:
        if isinstance(value, mx.array):
            arrays[name] = mx.contiguous(value)
        elif isinstance(value, (bool, int, float)):
            scalars.append((name, "scalar"))
            arrays[name] = mx.array(value)
        elif isinstance(value, str):
            scalars.append((name, "string"))
            arrays[name] = mx.array([ord(ch) for ch in value])
        elif value is None:
            scalars.append((name, "none"))
            arrays[name] = mx.array([])
        else:
            raise ValueError(f"a cache's state holds a {type(value).__name__}, which cannot be saved")
    mx.eval(list(arrays.values()))
    metadata = dict(tree_flatten([{"mlxpipe": str(FORMAT)}, [type(c).__name__ for c in cache], scalars]))
    tensors = tuple(Tensor(name, _DTYPES[a.dtype], tuple(a.shape), _buffer(a)) for name, a in sorted(arrays.items()))
    return Snapshot(as_tokens(tokens), tensors, metadata, can_trim_prompt_cache(list(cache)))


def _buffer(array: mx.array) -> memoryview:
    """An evaluated array's own bytes (MLX arrays export the buffer protocol; their stubs do not say so)."""
    exporter: Any = array
    return memoryview(exporter)


def write_safetensors(path: Path, tensors: Sequence[Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file from buffers (no MLX call: safe off the rank's thread); its CRC-32."""
    header: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors asks
    crc = 0
    chunks: list[bytes | memoryview] = [struct.pack("<Q", len(head)), head, *(t.data for t in tensors)]
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
    return crc


def file_crc(path: Path) -> tuple[int, int]:
    """A file's size and CRC-32, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc
