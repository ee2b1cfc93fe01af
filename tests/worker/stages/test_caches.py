"""worker/stages/caches.py: a send tied into the cache state, and stand-in caches that keep the real bookkeeping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CACHE_KINDS = ["KVCache", "RotatingKVCache", "QuantizedKVCache", "ArraysCache", "CacheList"]


def _make_cache(kind: str) -> Any:
    from mlx_lm.models import cache

    if kind == "RotatingKVCache":
        return cache.RotatingKVCache(max_size=8)
    if kind == "QuantizedKVCache":
        return cache.QuantizedKVCache(group_size=32, bits=4)
    if kind == "ArraysCache":
        return cache.ArraysCache(size=2)
    if kind == "CacheList":
        return cache.CacheList(cache.ArraysCache(size=1), cache.KVCache())
    return cache.KVCache()


def _feed(c: Any, num_tokens: int) -> None:
    """What a real layer does to its cache for ``num_tokens`` tokens."""
    import mlx.core as mx
    from mlx_lm.models import cache

    if isinstance(c, cache.CacheList):
        for sub in c.caches:
            _feed(sub, num_tokens)
    elif isinstance(c, cache.ArraysCache):
        c[0] = mx.ones((1, 3, 32))
    else:
        kv = mx.ones((1, 2, num_tokens, 32))
        c.update_and_fetch(kv, kv)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_tie_puts_the_send_into_the_cache_state(kind: str, tmp_path: Path) -> None:
    """Prefill evaluates only cache state: the send must be part of its graph."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxpipe.worker.stages.caches import tie_into_cache

    c = _make_cache(kind)
    _feed(c, 5)
    mx.eval([a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
    tie_into_cache(c, mx.exp(mx.ones(3)))  # stands in for the send
    dot = tmp_path / "state.dot"
    mx.export_to_dot(str(dot), *[a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
    assert "Exp" in dot.read_text()


@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache", "QuantizedKVCache", "CacheList"])
def test_stand_in_caches_keep_the_real_bookkeeping(kind: str) -> None:
    """A stand-in's cache gives the same offsets and masks as the real layer's."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import CacheList, trim_prompt_cache

    from mlxpipe.worker.stages.caches import advance_cache

    real, stand_in = _make_cache(kind), _make_cache(kind)
    for step in [5, 8, 1, 1, 1, 1, 1, 1, 1, 1, 3]:
        _feed(real, step)
        advance_cache(stand_in, 1, step)
        for r, s in _kv_parts(real, stand_in, CacheList):
            assert (r.offset, getattr(r, "_idx", None)) == (s.offset, getattr(s, "_idx", None))
            for n, window, as_array in [(1, None, 0), (4, None, 1), (4, 4, 0), (1, 4, 0)]:
                h = mx.zeros((1, n, 8))
                m_real = create_attention_mask(h, r, window_size=window, return_array=bool(as_array))
                m_stand = create_attention_mask(h, s, window_size=window, return_array=bool(as_array))
                if isinstance(m_real, mx.array):
                    assert mx.array_equal(m_real, m_stand)
                else:
                    assert m_real == m_stand
    if real.is_trimmable():  # not full rotating caches, nor recurrent state
        assert trim_prompt_cache([real], 3) == trim_prompt_cache([stand_in], 3) == 3
        assert [r.offset for r, _ in _kv_parts(real, real, CacheList)] == [
            s.offset for s, _ in _kv_parts(stand_in, stand_in, CacheList)
        ]


def _kv_parts(real: Any, stand_in: Any, cache_list: type) -> list[tuple[Any, Any]]:
    """Pairs of the position-keeping caches inside ``real`` and ``stand_in``."""
    if isinstance(real, cache_list):
        return [(r, s) for r, s in zip(real.caches, stand_in.caches, strict=True) if hasattr(r, "offset")]
    return [(real, stand_in)]
