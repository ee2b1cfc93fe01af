"""The prompt cache's disk tier: each rank's own slice of a prompt prefix's KV caches, kept across restarts.

mlx-lm's ``LRUPromptCache`` (the memory tier, ``--prompt-cache-size``) lives and dies with the rank, and
shares its RAM with the model. Here each rank also keeps, in a directory on its own host, the caches of the
prefixes it computed: its own layers' (a stand-in layer's cache holds no keys, only its offset) and, under
``--tp``, its own heads'. They are written in mlx-lm's prompt cache format (``save_prompt_cache``'s layout,
read back by ``load_prompt_cache``), bounded by size, least recently used out.

The rank's folder is ``<dir>/<slice>/``, ``<slice>`` a digest of what the rank holds (the model's files, its
layers, its place in its tensor group, the cache settings, mlx-lm's version; ``slice.json`` says it in
words), so that another split or model never reads a slice that is not its own. An entry is two files:
``<key>.safetensors`` (the caches) and ``<key>.json`` (its tokens, size and CRC-32), ``key`` the SHA-256 of
its tokens. Each is written whole (a temporary file, then a rename), the JSON last: an entry without it, or
whose data does not match its size and CRC, is removed, never loaded.

Writes run on a thread of their own: the rank's thread only takes a ``Snapshot`` (the arrays made contiguous
and evaluated, held as buffers: ``disk_files``), and the writer puts those bytes in a file without calling MLX.
Loads run on the rank's thread, when every rank admits the request (``generation.engine``): the ranks first agree
on how many tokens every one of them can give, then that every one loaded its slice; a rank that could not makes
it a miss for all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, trim_prompt_cache

from mlxpipe.paths import write_atomic
from mlxpipe.protocol.job import JobSpec
from mlxpipe.worker.caches.disk_files import (
    FORMAT,
    Snapshot,
    Tokens,
    as_tokens,
    file_crc,
    saveable,
    snapshot,
    write_safetensors,
)

MIN_TOKENS = 256  # shorter prefixes are not kept: they prefill in a moment, and would fill the folder with files
_PENDING = 4  # snapshots waiting for the writer; beyond them, the oldest is dropped (the memory tier has it)
_STALE_SECONDS = 600.0  # a temporary file this old is a crashed writer's


def key_of(tokens: Sequence[int] | Tokens) -> str:
    """An entry's name: the SHA-256 of its tokens (as little-endian 32-bit ints)."""
    return hashlib.sha256(as_tokens(tokens).tobytes()).hexdigest()


def slice_folder(identity: dict[str, Any]) -> str:
    """The folder name of a slice: a digest of its identity (``slice_identity``)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def common_prefix(a: Tokens, b: Tokens) -> int:
    """How many leading tokens ``a`` and ``b`` share (one vectorized comparison: microseconds for thousands)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def trim(cache: list[Any], tokens: int) -> int:
    """mlx-lm's ``trim_prompt_cache``: the tokens trimmed (its annotation says a list; it returns a count)."""
    trimmed: Any = trim_prompt_cache(cache, tokens)
    return int(trimmed)


@dataclass
class Entry:
    """One kept prefix: its tokens, its files' size, its data's CRC-32, when it was last used."""

    key: str
    tokens: Tokens
    nbytes: int  # both files
    size: int  # the safetensors file alone
    crc: int
    trimmable: bool
    used: float

    def serves(self, prompt: Tokens, limit: int) -> int:
        """How many of ``prompt``'s tokens this entry can give, at most ``limit`` (0: none)."""
        n = min(common_prefix(self.tokens, prompt), limit)
        return n if n == len(self.tokens) or self.trimmable else 0


@dataclass
class DiskStats:
    """What a rank's disk tier did since it opened (seconds: the rank's own thread's, and the writer's)."""

    loads: int = 0
    load_seconds: float = 0.0
    snapshot_seconds: float = 0.0  # the rank's thread, taking snapshots for the writer
    writes: int = 0
    write_seconds: float = 0.0  # the writer's thread
    dropped: int = 0  # snapshots the writer had no time for
    removed: int = 0  # bad files removed (partial, corrupt, unreadable)
    errors: list[str] = field(default_factory=list)  # the last few write failures, for the rank's report


class DiskCache:
    """One rank's disk tier (see the module docstring): ``usable`` and ``load`` on the rank's thread, ``save``
    queued for the writer thread."""

    def __init__(self, directory: Path, max_bytes: int, identity: dict[str, Any], min_tokens: int = MIN_TOKENS) -> None:
        self.root = directory
        self.folder = directory / slice_folder(identity)
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.stats = DiskStats()
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / "slice.json", json.dumps(identity, indent=1, sort_keys=True))
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="mlxpipe-disk-cache")
        self._writer.start()

    # --- what is kept ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def figures(self) -> dict[str, float]:
        """For the rank's ``time`` event: what is kept and what the tier did."""
        s = self.stats
        return {"entries": len(self), "gb": self.nbytes / 1e9, "loads": s.loads, "load_s": s.load_seconds,
                "writes": s.writes, "write_s": s.write_seconds, "snapshot_s": s.snapshot_seconds,
                "dropped": s.dropped, "removed": s.removed}

    def _scan(self) -> None:
        """The entries a run before this one left: complete ones kept (oldest use first out), the rest removed."""
        now = time.time()
        for meta in self.folder.glob("*.json"):
            if meta.name == "slice.json":
                continue
            entry = self._read_entry(meta)
            if entry is None:
                self._remove_files(meta.stem)
                self.stats.removed += 1
            else:
                self._entries[entry.key] = entry
        for path in self.folder.iterdir():
            orphan = path.suffix == ".safetensors" and path.stem not in self._entries
            if (orphan or path.name.startswith(".")) and now - _mtime(path) > _STALE_SECONDS:
                path.unlink(missing_ok=True)  # a writer that died between its two files, or part-way
        with self._lock:
            self._evict(keep=None)

    def _read_entry(self, meta: Path) -> Entry | None:
        """An entry's JSON file read, and its data file's size checked against it (None: not a whole entry)."""
        try:
            record = json.loads(meta.read_text())
            tokens = as_tokens([int(t) for t in record["tokens"]])
            size, crc, trimmable = int(record["size"]), int(record["crc32"]), bool(record["trimmable"])
            data = meta.with_suffix(".safetensors")
            if record["format"] != FORMAT or key_of(tokens) != meta.stem or data.stat().st_size != size:
                return None
            return Entry(meta.stem, tokens, size + meta.stat().st_size, size, crc, trimmable, meta.stat().st_mtime)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # --- the rank's thread ------------------------------------------------------------

    def usable(self, prompt: Sequence[int]) -> int:
        """The most of ``prompt``'s tokens one entry here can give (never its last token, which must be fed
        for the logits); 0 below ``min_tokens``."""
        with self._lock:
            entries = list(self._entries.values())
        wanted = as_tokens(prompt)
        best = max((e.serves(wanted, len(wanted) - 1) for e in entries), default=0)
        return best if best >= self.min_tokens else 0

    def load(self, prompt: Sequence[int], length: int) -> list[Any] | None:
        """Caches holding ``prompt``'s first ``length`` tokens, from an entry that gives them (checked whole
        first: a bad one is removed); None when no entry here can."""
        tic = time.perf_counter()
        try:
            for entry in self._candidates(prompt, length):
                cache = self._load(entry, length)
                if cache is not None:
                    self.stats.loads += 1
                    return cache
            return None
        finally:
            self.stats.load_seconds += time.perf_counter() - tic

    def _candidates(self, prompt: Sequence[int], length: int) -> list[Entry]:
        """The entries that give ``length`` tokens of ``prompt``, the smallest first (the least to read)."""
        with self._lock:
            entries = list(self._entries.values())
        wanted = as_tokens(prompt)
        return sorted((e for e in entries if e.serves(wanted, length) == length), key=lambda e: e.size)

    def _load(self, entry: Entry, length: int) -> list[Any] | None:
        path = self.folder / f"{entry.key}.safetensors"
        try:
            if file_crc(path) != (entry.size, entry.crc):
                raise ValueError("its data does not match its size and CRC-32")
            cache: list[Any] = load_prompt_cache(str(path))
            extra = len(entry.tokens) - length
            if extra and trim(cache, extra) != extra:
                raise ValueError("it cannot be trimmed")
            mx.eval([c.state for c in cache])
            if any(getattr(c, "offset", length) != length for c in cache):
                raise ValueError("its caches do not hold its tokens")
        except FileNotFoundError:
            self._forget(entry.key)  # evicted by the writer meanwhile
            return None
        except Exception:  # noqa: BLE001 - whatever a bad file raises, it is never used: removed, a miss
            self._forget(entry.key, remove=True)
            self.stats.removed += 1
            return None
        self._touch(entry)
        return cache

    def save(self, tokens: Sequence[int], cache: Sequence[Any]) -> bool:
        """Queue ``cache`` (holding exactly ``tokens``) for the writer; False when it is not kept (too short,
        already kept, a kind of cache that cannot be saved, or larger than the whole tier)."""
        if len(tokens) < self.min_tokens or not saveable(cache) or self._covered(tokens):
            return False
        tic = time.perf_counter()
        snap = snapshot(tokens, cache)
        self.stats.snapshot_seconds += time.perf_counter() - tic
        if snap.nbytes > self.max_bytes:
            return False
        while self._queue.qsize() >= _PENDING:
            try:
                self._queue.get_nowait()
                self.stats.dropped += 1
            except queue.Empty:
                break
        self._queue.put(snap)
        return True

    def _covered(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already gives all of ``tokens`` (it is them, or a longer one that can be trimmed);
        that entry counts as used."""
        wanted = as_tokens(tokens)
        with self._lock:
            entry = self._entries.get(key_of(wanted)) or next(
                (e for e in self._entries.values()
                 if e.trimmable and len(e.tokens) > len(wanted) and common_prefix(e.tokens, wanted) == len(wanted)),
                None)
        if entry is not None:
            self._touch(entry)
        return entry is not None

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (at most ``timeout`` seconds), then stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout)

    # --- the writer's thread ----------------------------------------------------------

    def _write_loop(self) -> None:
        while (snap := self._queue.get()) is not None:
            tic = time.perf_counter()
            try:
                self._write(snap)
                self.stats.writes += 1
            except Exception as e:  # noqa: BLE001 - a full disk, a folder gone: that prefix is not kept
                self.stats.errors = [*self.stats.errors[-4:], f"{type(e).__name__}: {e}"]
            self.stats.write_seconds += time.perf_counter() - tic

    def _write(self, snap: Snapshot) -> None:
        key = key_of(snap.tokens)
        data, meta = self.folder / f"{key}.safetensors", self.folder / f"{key}.json"
        tmp = self.folder / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            crc = write_safetensors(tmp, snap.tensors, snap.metadata)
            os.replace(tmp, data)
        finally:
            tmp.unlink(missing_ok=True)
        size = data.stat().st_size
        record = {"format": FORMAT, "tokens": snap.tokens.tolist(), "size": size, "crc32": crc,
                  "trimmable": snap.trimmable}
        write_atomic(meta, json.dumps(record, separators=(",", ":")))  # last: the entry now exists
        entry = Entry(key, snap.tokens, size + meta.stat().st_size, size, crc, snap.trimmable, time.time())
        with self._lock:
            self._entries[key] = entry
            if snap.trimmable:  # as LRUPromptCache: a prefix of a trimmable entry only takes space
                for other in [e for e in self._entries.values() if len(e.tokens) < len(entry.tokens)
                              and common_prefix(entry.tokens, e.tokens) == len(e.tokens)]:
                    self._drop(other.key)
            self._evict(keep=key)

    # --- both -------------------------------------------------------------------------

    def _evict(self, keep: str | None) -> None:
        """Least recently used out until the entries fit (under the lock); ``keep`` goes last."""
        total = sum(e.nbytes for e in self._entries.values())
        for entry in sorted(self._entries.values(), key=lambda e: (e.key == keep, e.used)):
            if total <= self.max_bytes:
                break
            total -= entry.nbytes
            self._drop(entry.key)

    def _touch(self, entry: Entry) -> None:
        """``entry`` was used now: last out (its JSON file's time says so to the next run)."""
        entry.used = time.time()
        with contextlib.suppress(OSError):  # removed meanwhile: nothing to keep in order
            os.utime(self.folder / f"{entry.key}.json")

    def _forget(self, key: str, remove: bool = False) -> None:
        with self._lock:
            if remove:
                self._drop(key)
            else:
                self._entries.pop(key, None)

    def _drop(self, key: str) -> None:
        """Remove an entry and its files (under the lock)."""
        self._entries.pop(key, None)
        self._remove_files(key)

    def _remove_files(self, key: str) -> None:
        (self.folder / f"{key}.json").unlink(missing_ok=True)  # first: the entry is gone for any reader
        (self.folder / f"{key}.safetensors").unlink(missing_ok=True)


def slice_identity(job: JobSpec, rank: int, layers: tuple[int, int], sharding: str) -> dict[str, Any]:
    """What decides the caches ``rank`` computes: the model's files (names, sizes, times), its layers, its
    place in its tensor group and how the group sliced them, the cache settings, the adapters, mlx-lm."""
    import mlx_lm

    model = Path(job.model_paths[rank]).expanduser()
    adapters = Path(job.adapter_path).expanduser() if job.adapter_path else None
    return {
        "format": FORMAT,
        "mlx_lm": mlx_lm.__version__,
        "model": str(model.resolve()),
        "files": _files(model, lambda p: p.suffix == ".safetensors" or p.name == "config.json"),
        "layers": list(layers),
        "tp": [rank % job.tp, job.tp],
        "sharding": sharding,
        "mode": job.mode,
        "max_kv_size": job.max_kv_size,
        "adapters": _files(adapters, lambda p: True) if adapters is not None else None,
    }


def _files(folder: Path, wanted: Callable[[Path], bool]) -> list[list[Any]]:
    """Name, size and modification time of the files of ``folder`` that are ``wanted``."""
    out = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and wanted(path):
            st = path.stat()
            out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
