"""worker/caches/prompt_caches.py in one process (a group of one): which tier a request's caches come from, and which
tiers keep them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from fixtures.kv_caches import IDENTITY, MIN, caches, held
from mlxpipe.protocol.job import JobSpec
from mlxpipe.protocol.request import Request
from mlxpipe.worker.caches.disk_cache import DiskCache
from mlxpipe.worker.caches.prompt_caches import PromptCaches

MODEL = SimpleNamespace(layers=[None] * 3)  # make_prompt_cache: a KVCache per layer
JOB = JobSpec(["/m"], [3])


def tiers(tmp_path: Path, memory_size: int = 10) -> PromptCaches:
    from mlx_lm.models.cache import LRUPromptCache

    disk = DiskCache(tmp_path / "prompt-cache", 10**8, IDENTITY, min_tokens=MIN)
    return PromptCaches(MODEL, JOB, mx.distributed.init(), LRUPromptCache(memory_size) if memory_size else None, disk)


def kept_on_disk(caches_: PromptCaches) -> None:
    assert caches_.disk is not None
    caches_.disk.close()
    caches_.disk = DiskCache(caches_.disk.root, caches_.disk.max_bytes, IDENTITY, min_tokens=MIN)


def test_a_miss_makes_empty_caches(tmp_path: Path) -> None:
    found = tiers(tmp_path).fetch(list(range(50)), Request(tokens=list(range(50))))
    assert found.tier is None and found.tokens == 0 and [c.offset for c in found.cache] == [0, 0, 0]


def test_the_memory_tier_first_and_the_disk_when_it_gives_more(tmp_path: Path) -> None:
    both = tiers(tmp_path)
    long, short = list(range(40)), list(range(20))
    both.keep(long, caches(40), Request())
    kept_on_disk(both)
    assert both.memory is not None
    both.memory.trim_to(n_sequences=0)
    both.keep(short, caches(20, stand_in=False), Request())  # memory: 20 tokens; disk: the 40 already kept
    found = both.fetch([*long, 1], Request())
    assert found.tier == "disk" and found.tokens == 40 and held(found.cache) == held(caches(40))
    found = both.fetch([*short, 1], Request())
    assert found.tier == "memory" and found.tokens == 20  # the disk gives no more: it is not read


def test_quantized_or_other_sized_caches_stay_off_the_disk(tmp_path: Path) -> None:
    only_disk = tiers(tmp_path, memory_size=0)
    tokens = list(range(40))
    only_disk.keep(tokens, caches(40), Request(kv_bits=4))
    only_disk.keep(tokens, caches(40), Request(max_kv_size=64))
    kept_on_disk(only_disk)
    assert only_disk.disk is not None and len(only_disk.disk) == 0
    only_disk.keep(tokens, caches(40), Request())
    kept_on_disk(only_disk)
    assert only_disk.fetch([*tokens, 1], Request(kv_bits=4)).tier is None
    assert only_disk.fetch([*tokens, 1], Request()).tier == "disk"
