"""worker/caches/disk_cache.py: the prompt cache's disk tier on one rank, its files, keys, LRU bound and bad files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, RotatingKVCache, load_prompt_cache

from fixtures.kv_caches import IDENTITY, MIN, caches, held
from mlxpipe.protocol.job import JobSpec
from mlxpipe.worker.caches.disk_cache import DiskCache, common_prefix, key_of, slice_folder, slice_identity
from mlxpipe.worker.caches.disk_files import as_tokens


def store(tmp_path: Path, max_bytes: int = 10**8, identity: dict[str, Any] = IDENTITY) -> DiskCache:
    return DiskCache(tmp_path / "prompt-cache", max_bytes, identity, min_tokens=MIN)


def saved(disk: DiskCache, tokens: list[int], cache: list[Any]) -> DiskCache:
    """Save, and wait for the writer: a new store on the same folder (a restart) sees it."""
    assert disk.save(tokens, cache)
    disk.close()
    return DiskCache(disk.root, disk.max_bytes, json.loads((disk.folder / "slice.json").read_text()), min_tokens=MIN)


def entries(disk: DiskCache) -> set[str]:
    return {p.stem for p in disk.folder.glob("*.json") if p.name != "slice.json"}


def test_a_prefix_survives_a_restart_whole(tmp_path: Path) -> None:
    tokens = list(range(40))
    original = caches(40)
    disk = saved(store(tmp_path), tokens, original)
    assert entries(disk) == {key_of(tokens)} and len(disk) == 1
    # The whole prompt is never given: its last token is fed for the logits.
    assert disk.usable(tokens) == 39 and disk.usable([*tokens, 7, 8]) == 40
    loaded = disk.load([*tokens, 7], 40)
    assert loaded is not None and [c.offset for c in loaded] == [40, 40, 40]
    assert held(loaded) == held(original)
    assert loaded[0].state[0].shape[-1] == 0  # the stand-in stays a stand-in
    # mlx-lm reads the file as it reads its own.
    assert held(load_prompt_cache(str(disk.folder / f"{key_of(tokens)}.safetensors"))) == held(original)


def test_a_longer_entry_is_trimmed_to_the_shared_prefix(tmp_path: Path) -> None:
    tokens = list(range(40))
    original = caches(40)
    disk = saved(store(tmp_path), tokens, original)
    other = [*tokens[:30], 99, 98, 97]
    assert disk.usable(other) == 30
    loaded = disk.load(other, 30)
    assert loaded is not None and [c.offset for c in loaded] == [30, 30, 30]
    assert held(loaded) == [layer[..., :30, :].tolist() for c in original for layer in c.state[:2]]
    assert disk.usable([*tokens[: MIN - 1], 99, 98]) == 0  # a shared prefix below min_tokens is not worth a read


def test_an_entry_that_cannot_be_trimmed_serves_only_prompts_it_begins(tmp_path: Path) -> None:
    rotated = []
    for _ in range(2):
        cache = RotatingKVCache(max_size=16)
        keys = mx.random.normal((1, 2, 20, 4))
        cache.update_and_fetch(keys, keys)  # beyond its window: it can no longer be trimmed
        rotated.append(cache)
    mx.eval([c.state for c in rotated])
    tokens = list(range(20))
    disk = saved(store(tmp_path), tokens, rotated)
    assert disk.usable([*tokens[:15], 5, 5]) == 0
    assert disk.usable(tokens) == 0  # the whole prompt needs a token trimmed
    assert disk.usable([*tokens, 1]) == 20
    loaded = disk.load([*tokens, 1], 20)
    assert loaded is not None and [type(c).__name__ for c in loaded] == ["RotatingKVCache"] * 2
    assert [c.state[:2][0].tolist() for c in loaded] == [c.state[:2][0].tolist() for c in rotated]


def test_what_is_not_kept(tmp_path: Path) -> None:
    disk = store(tmp_path)
    assert not disk.save(list(range(MIN - 1)), caches(MIN - 1))  # too short to be worth a file
    arrays = ArraysCache(2)  # a recurrent state: fields outside its state, which mlx-lm's file does not restore
    assert not disk.save(list(range(20)), [arrays])
    assert not DiskCache(tmp_path / "small", 1000, IDENTITY, min_tokens=MIN).save(list(range(40)), caches(40))
    disk.close()
    assert entries(disk) == set()


def test_keys_name_the_tokens_and_folders_the_slice(tmp_path: Path, tiny_models: Any) -> None:
    assert key_of([1, 2, 3]) != key_of([1, 2, 4]) and key_of([1, 2, 3]) == key_of((1, 2, 3))
    # Another split, tensor group or model is another folder: a rank never reads a slice that is not its own.
    path = tiny_models["qwen2"]
    job = JobSpec([str(path), str(path)], [3, 3])
    own = slice_identity(job, 0, (3, 6), "none")
    assert own["layers"] == [3, 6] and own["tp"] == [0, 1] and own["model"] == str(path.resolve())
    assert any(name.endswith(".safetensors") for name, _, _ in own["files"])
    others = [slice_identity(job, 1, (0, 3), "none"),
              slice_identity(JobSpec([str(path)] * 2, [6], tp=2), 1, (0, 6), "generic"),
              slice_identity(JobSpec([str(path)] * 2, [3, 3], max_kv_size=64), 0, (3, 6), "none")]
    assert len({slice_folder(i) for i in [own, *others]}) == 4
    assert slice_folder(own) == slice_folder(slice_identity(job, 0, (3, 6), "none"))
    a, b = store(tmp_path, identity=own), store(tmp_path, identity=others[0])
    assert a.folder != b.folder and a.folder.parent == b.folder.parent
    assert json.loads((a.folder / "slice.json").read_text()) == own


def test_a_prefix_of_a_kept_entry_is_not_kept_twice(tmp_path: Path) -> None:
    disk = store(tmp_path)
    short, long = list(range(20)), list(range(40))
    disk = saved(disk, short, caches(20))
    disk = saved(disk, long, caches(40))
    assert entries(disk) == {key_of(long)}  # as LRUPromptCache: the prefix of a trimmable entry only takes space
    assert not disk.save(short, caches(20))  # already given by the longer one
    assert not disk.save(long, caches(40))  # already kept


def test_least_recently_used_out_by_size(tmp_path: Path) -> None:
    one = saved(store(tmp_path), list(range(100, 140)), caches(40)).nbytes
    disk = store(tmp_path, max_bytes=int(one * 2.5))
    first, second, third = (list(range(n, n + 40)) for n in (100, 200, 300))
    disk = saved(disk, second, caches(40))
    assert len(disk) == 2
    time.sleep(0.01)
    assert disk.load([*first, 0], 40) is not None  # used now: second is the least recently used
    disk = saved(disk, third, caches(40))
    assert entries(disk) == {key_of(first), key_of(third)} and disk.nbytes <= disk.max_bytes
    # The order survives a restart (the JSON files' times): the next one evicts first.
    time.sleep(0.01)
    assert disk.load([*third, 0], 40) is not None
    disk = saved(disk, second, caches(40))
    assert entries(disk) == {key_of(second), key_of(third)}
    # A smaller bound at the next start evicts at once.
    assert len(DiskCache(disk.root, one + 10, json.loads((disk.folder / "slice.json").read_text()), MIN)) == 1


def test_writes_are_whole_or_absent(tmp_path: Path) -> None:
    disk = store(tmp_path)
    tokens = list(range(40))
    disk = saved(disk, tokens, caches(40))
    names = sorted(p.name for p in disk.folder.iterdir())
    assert names == sorted([f"{key_of(tokens)}.json", f"{key_of(tokens)}.safetensors", "slice.json"])  # no temp
    # A writer that died: part of a file under a temporary name, and data whose JSON was never written.
    stale = time.time() - 3600
    partial = disk.folder / f".{key_of([1])}.123.456.tmp"
    orphan = disk.folder / f"{key_of(list(range(50)))}.safetensors"
    for path in (partial, orphan):
        path.write_bytes(b"\0" * 100)
        os.utime(path, (stale, stale))
    fresh = disk.folder / f".{key_of([2])}.123.456.tmp"  # another process may be writing it now
    fresh.write_bytes(b"\0")
    disk = DiskCache(disk.root, disk.max_bytes, json.loads((disk.folder / "slice.json").read_text()), MIN)
    assert not partial.exists() and not orphan.exists() and fresh.exists()
    assert entries(disk) == {key_of(tokens)}
    assert disk.usable(list(range(60))) == 40  # the orphan was never an entry


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_damaged_file_is_removed_never_loaded(tmp_path: Path, damage: str) -> None:
    tokens = list(range(40))
    disk = saved(store(tmp_path), tokens, caches(40))
    data = disk.folder / f"{key_of(tokens)}.safetensors"
    content = bytearray(data.read_bytes())
    if damage == "truncated":
        content = content[: len(content) // 2]
    elif damage == "flipped":
        content[-5] ^= 0xFF  # the same size: only the CRC tells
    else:
        content = bytearray()
    data.write_bytes(bytes(content))
    if damage != "flipped":  # a size that does not match is seen at the next start
        restarted = DiskCache(disk.root, disk.max_bytes, json.loads((disk.folder / "slice.json").read_text()), MIN)
        assert len(restarted) == 0 and not data.exists() and restarted.stats.removed == 1
    assert disk.usable([*tokens, 1]) == 40  # this run still lists it...
    assert disk.load([*tokens, 1], 40) is None  # ...but never loads it
    assert not data.exists() and entries(disk) == set() and disk.usable([*tokens, 1]) == 0


def test_a_bad_json_file_is_removed(tmp_path: Path) -> None:
    tokens = list(range(40))
    disk = saved(store(tmp_path), tokens, caches(40))
    meta = disk.folder / f"{key_of(tokens)}.json"
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "tokens": record["tokens"][:-1]}))  # tokens that are not its key's
    disk = DiskCache(disk.root, disk.max_bytes, json.loads((disk.folder / "slice.json").read_text()), MIN)
    assert len(disk) == 0 and not (disk.folder / f"{key_of(tokens)}.safetensors").exists()


def test_a_decode_groups_row_is_saved_as_its_own_cache(tmp_path: Path) -> None:
    """A request leaves a decode group with a view of the group's batch caches: written as its own."""
    rows = [caches(40, seed=1, stand_in=False), caches(30, seed=2, stand_in=False)]
    batch = [BatchKVCache.merge([rows[0][i], rows[1][i]]) for i in range(3)]
    own = [c.extract(1) for c in batch]
    disk = saved(store(tmp_path), list(range(30)), own)
    loaded = disk.load([*range(30), 5], 30)
    assert loaded is not None and held(loaded) == held(rows[1])


def test_common_prefix() -> None:
    def shared(a: list[int], b: list[int]) -> int:
        return common_prefix(as_tokens(a), as_tokens(b))

    assert shared([1, 2, 3], [1, 2, 3]) == 3
    assert shared([1, 2, 3], [1, 2]) == 2
    assert shared([1, 2, 3], [1, 5, 3]) == 1
    assert shared([], [1]) == 0 and shared([4], [1]) == 0
    assert shared(list(range(1000)), [*range(637), 0]) == 637
