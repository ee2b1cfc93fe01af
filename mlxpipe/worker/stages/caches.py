"""Caches on a cut model: a stand-in's kept in step without storing, the send tied into a real one's."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from mlxpipe.errors import ModelError


def advance_cache(cache: Any, batch: int, num_tokens: int) -> None:
    """Advance a stand-in's cache by ``num_tokens`` without storing anything.

    Zero-width keys and values run through the cache's own ``update_and_fetch``
    so offsets and rotation indices move exactly as the real layer's would.
    """
    if cache is None:
        return
    if _is_cache_list(cache):
        for sub in cache.caches:
            advance_cache(sub, batch, num_tokens)
        return
    if not hasattr(cache, "update_and_fetch"):
        return  # recurrent state (ArraysCache): no positions to keep
    empty = mx.zeros((batch, 1, num_tokens, 0))
    cache.update_and_fetch(empty, empty)
    # Fresh leaves keep the never-evaluated graph of a stand-in from growing.
    cache.state = _fresh_empty(cache.state)


def _is_cache_list(cache: Any) -> bool:
    """mlx-lm's ``CacheList``, or mlx-vlm's of the same name (its language models' caches)."""
    return isinstance(cache, CacheList) or type(cache).__name__ == "CacheList"


def _fresh_empty(tree: Any) -> Any:
    """``tree`` with every zero-size array replaced by a new one of its shape."""
    if isinstance(tree, mx.array):
        return mx.zeros(tree.shape, tree.dtype) if tree.size == 0 else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fresh_empty(t) for t in tree)
    return tree


def tie_into_cache(cache: Any, dependency: mx.array) -> None:
    """Make the cache's state depend on ``dependency`` (the send).

    mlx-lm's prefill evaluates only ``cache.state``; a send nothing in it
    depends on would never run and the receiving rank would wait forever.
    """
    if _is_cache_list(cache):
        for sub in cache.caches:
            if _has_array(sub.state):
                tie_into_cache(sub, dependency)
                return
        raise ModelError("cannot tie the pipeline send into an empty CacheList")
    tied, done = _depend_first(cache.state, dependency)
    if not done:
        raise ModelError(f"cannot tie the pipeline send into a {type(cache).__name__}")
    try:
        cache.state = tied
    except (AttributeError, TypeError, ValueError) as e:
        raise ModelError(
            f"cannot tie the pipeline send into a {type(cache).__name__}: {e}"
        ) from e


def _depend_first(tree: Any, dependency: mx.array) -> tuple[Any, bool]:
    """``tree`` with its first array made to depend on ``dependency``."""
    if isinstance(tree, mx.array):
        return mx.depends(tree, dependency), True
    if isinstance(tree, (list, tuple)):
        items, done = list(tree), False
        for i, item in enumerate(items):
            items[i], done = _depend_first(item, dependency)
            if done:
                break
        return type(tree)(items), done
    return tree, False


def _has_array(tree: Any) -> bool:
    """Whether ``tree`` holds an mx.array anywhere."""
    if isinstance(tree, mx.array):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_has_array(t) for t in tree)
    return False
