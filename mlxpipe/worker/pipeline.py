"""Pipeline parallelism for any mlx-lm text model that keeps its blocks in a list.

mlx-lm pipelines a model only when the architecture's own ``__call__`` was
written for it (``PipelineMixin``). The generic wrapper here leaves the model
code untouched and changes only the entries of its ``layers`` list, with
mlx-lm's convention: rank 0 runs the last layers, the highest rank the first.

* Layers held by other ranks become *stand-ins*: the same objects with their
  weights removed and their class swapped for a subclass whose ``__call__``
  passes the hidden state through. Model code still reads their attributes
  (``use_sliding``, ``self_attn.is_local``, ``isinstance`` checks) unchanged.
  A stand-in feeds its cache zero-width keys and values, so the cache's own
  code advances its offset and rotation exactly as for the real layer: masks
  built from ``cache[0]`` or any other layer's cache stay right on every rank.
  mlx-lm's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``) advance
  the same way, per-request offsets and left padding included, and merge,
  filter and extend like the real layers' (zero-width rows).
* The first local layer receives the hidden state from rank + 1; the last
  local layer sends it to rank - 1 and ties the send into its cache, because
  mlx-lm's prefill evaluates only the caches.
* After the model's last layer every rank all-gathers the hidden state and
  keeps rank 0's part, so every rank computes the same logits and samples the
  same token.

Overlapped requests (``mlxpipe.worker.engine``) move hidden states
themselves, between micro-batches of different requests: with the rank's
``Exchange`` made explicit, the first local layer takes ``hidden_in``, the last
one leaves its output in ``hidden_out``, and nothing is sent or gathered.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, _BaseCache

from mlxpipe.errors import ModelError
from mlxpipe.worker.job import layer_range

# Architectures whose layers exchange more than the hidden state (shared KV
# caches, values from the first layer, several passes over the stack): cutting
# them between ranks would give wrong tokens, so they are refused up front.
UNSUPPORTED_MODEL_TYPES: dict[str, str] = {
    "afm7": "its KV-reuse layers read the last layer's cache",
    "deepseek_v41": "its layers pass hyper-connection streams to each other",
    "gemma3n": "its layers share KV caches across the stack",
    "gemma4": "its layers share KV caches across the stack",
    "gemma4_text": "its layers share KV caches across the stack",
    "hunyuan": "its layers pass shared KV states to the next layer",
    "iquestloopcoder": "its model runs each block's attention itself, twice, instead of calling the blocks",
    "kimi_k3": "its layers pass attention blocks to the next layer",
    "muse_spark": "its layers pass attention inputs to the next layer",
    "nanbeige": "it runs the layer stack several times",
    "phi3small": "a rank crashes (MLX segfault) when its block-sparse attention stack is cut; not yet understood",
    "rwkv7": "its layers pass the first layer's values to later layers",
}


class Exchange:
    """How this rank's boundary layers move the hidden state; one per pipelined model.

    By default they receive, send and gather themselves, as one request's
    generation needs. ``explicit`` is for a loop that moves the states itself:
    the first local layer then takes ``hidden_in`` (or the incoming state as is
    when None, remembering its shape and dtype in ``incoming``), and the last
    local layer leaves its output in ``hidden_out``.
    """

    def __init__(self) -> None:
        self.explicit = False
        self.hidden_in: mx.array | None = None
        self.hidden_out: mx.array | None = None
        self.incoming: tuple[tuple[int, ...], Any] | None = None
        # The last block's output in this forward pass: the next block's hidden state.
        self.last_out: mx.array | None = None


@dataclass(frozen=True)
class _Stage:
    """What one entry of the layers list does around (or instead of) its layer."""

    group: Any
    local: bool
    recv_from: int | None
    send_to: int | None
    gather: bool
    exchange: Exchange


class _PipelineStage:
    """Mixin put in front of a layer's class; see the module docstring."""

    _mlxpipe_stage: _Stage

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._mlxpipe_stage
        exchange = stage.exchange
        where, x = _find_hidden(self, args, kwargs, exchange.last_out)
        cache = _find_cache(args, kwargs)
        if stage.recv_from is not None:
            if not exchange.explicit:
                x = mx.distributed.recv_like(x, stage.recv_from, group=stage.group)
                if cache is None:
                    # Prefill evaluates only the caches: a receive no local cache
                    # depends on would stay unread, and the next one would read it.
                    mx.async_eval(x)
            else:
                exchange.incoming = (tuple(x.shape), x.dtype)
                if exchange.hidden_in is not None:
                    x = exchange.hidden_in
        if stage.local:
            args, kwargs = _put_hidden(where, x, args, kwargs)
            out = super().__call__(*args, **kwargs)  # type: ignore[misc]
            if not isinstance(out, mx.array):
                raise ModelError(
                    f"{type(self).__name__} returns {type(out).__name__}, not one "
                    "hidden state; the generic pipeline cannot cut this model"
                )
        else:
            advance_cache(cache, x.shape[0], x.shape[1])
            # A new array, not ``x`` itself: the next block must tell the state from
            # other arguments that were the same object (Talkie's embeddings).
            out = mx.stop_gradient(x)
        if stage.send_to is not None:
            if exchange.explicit:
                exchange.hidden_out = out
            else:
                out = mx.distributed.send(out, stage.send_to, group=stage.group)
                if cache is not None:
                    tie_into_cache(cache, out)
                else:
                    # A block without a cache (an MLP or MoE block): prefill evaluates
                    # only the caches, so nothing would run the send and the next rank
                    # would wait forever. Schedule it now, without waiting for it.
                    mx.async_eval(out)
        if stage.gather and not exchange.explicit:
            out = mx.distributed.all_gather(out, group=stage.group)[: out.shape[0]]
        exchange.last_out = out
        return out


def _find_hidden(layer: Any, args: tuple, kwargs: dict, previous: Any) -> tuple[int | str, mx.array]:
    """Where the hidden state is in the call (a position or a keyword), and its value.

    The hidden state is what the previous block returned: a model may pass
    other arrays first (Talkie hands every block the embeddings, then the
    state). For the first block, or a caller that transforms the state between
    blocks: the first positional, else the keyword naming the first parameter.
    """
    if previous is not None:
        for i, value in enumerate(args):
            if value is previous:
                return i, value
        for name, value in kwargs.items():
            if value is previous:
                return name, value
    if args:
        return 0, args[0]
    name = _first_parameter(type(layer).__mro__[2])  # the class behind the pipeline mixin
    if name in kwargs:
        return name, kwargs[name]
    raise ModelError("a layer was called without a hidden state the pipeline can find")


def _put_hidden(where: int | str, x: mx.array, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with the hidden state at ``where`` replaced by ``x``."""
    if isinstance(where, int):
        return args[:where] + (x,) + args[where + 1 :], kwargs
    return args, {**kwargs, where: x}


@lru_cache(maxsize=None)
def _first_parameter(cls: type) -> str | None:
    """The name of the first parameter of ``cls.__call__`` after ``self``."""
    try:
        params = list(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return None
    return params[1] if len(params) > 1 else None


def _find_cache(args: tuple, kwargs: dict) -> Any:
    """The cache object passed to a layer call, None when there is none."""
    if kwargs.get("cache") is not None:
        return kwargs["cache"]
    for value in (*args, *kwargs.values()):
        if isinstance(value, _BaseCache):
            return value
    return None


def advance_cache(cache: Any, batch: int, num_tokens: int) -> None:
    """Advance a stand-in's cache by ``num_tokens`` without storing anything.

    Zero-width keys and values run through the cache's own ``update_and_fetch``
    so offsets and rotation indices move exactly as the real layer's would.
    """
    if cache is None:
        return
    if isinstance(cache, CacheList):
        for sub in cache.caches:
            advance_cache(sub, batch, num_tokens)
        return
    if not hasattr(cache, "update_and_fetch"):
        return  # recurrent state (ArraysCache): no positions to keep
    empty = mx.zeros((batch, 1, num_tokens, 0))
    cache.update_and_fetch(empty, empty)
    # Fresh leaves keep the never-evaluated graph of a stand-in from growing.
    cache.state = _fresh_empty(cache.state)


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
    if isinstance(cache, CacheList):
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


def find_layers(model: nn.Module) -> tuple[nn.Module, str]:
    """The module and attribute name holding the model's list of blocks.

    Prefers the list ``model.layers`` names (the list mlx-lm builds caches
    for), else the shallowest attribute called ``layers`` holding modules.
    """
    target = getattr(model, "layers", None)
    candidates = sorted(model.named_modules(), key=lambda item: item[0].count("."))
    for _, module in candidates:
        for key, value in module.items():
            if _is_layer_list(value) and _same_layers(value, target):
                return module, key
    if target is None:
        for _, module in candidates:
            value = module.get("layers")
            if _is_layer_list(value):
                return module, "layers"
    raise ModelError(
        f"{type(model).__module__} keeps no list of layers the pipeline can split",
        hint="this architecture cannot be pipelined by mlxpipe",
    )


def _is_layer_list(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of modules."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, nn.Module) for v in value)
    )


def _same_layers(value: list, target: Any) -> bool:
    """Whether ``value`` holds the same layer objects as ``target``."""
    if target is None:
        return False
    if value is target:
        return True
    # ``layers`` properties may return a fresh slice of the list.
    return isinstance(target, list) and len(value) == len(target) and all(
        a is b for a, b in zip(value, target)
    )


def model_type_of(model: nn.Module) -> str:
    """The mlx-lm module name of the architecture (``qwen2``, ``llama``...)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def check_supported(model: nn.Module) -> None:
    """Raise ModelError when the generic pipeline cannot split ``model``."""
    reason = UNSUPPORTED_MODEL_TYPES.get(model_type_of(model))
    if reason is not None:
        raise ModelError(
            f"mlxpipe cannot pipeline {model_type_of(model)}: {reason}",
            hint="run it on one machine with mlx_lm.generate",
        )
    find_layers(model)


def has_native_pipeline(model: nn.Module) -> bool:
    """Whether mlx-lm's own ``pipeline()`` exists for this model."""
    inner = model.get("model")
    return isinstance(inner, nn.Module) and callable(getattr(inner, "pipeline", None))


def check_split(split: list[int], num_layers: int, group_size: int) -> None:
    """Raise ModelError unless ``split`` covers ``num_layers`` over the group."""
    if len(split) != group_size:
        raise ModelError(f"split {split} has {len(split)} entries for {group_size} ranks")
    if sum(split) != num_layers or any(n <= 0 for n in split):
        raise ModelError(
            f"split {split} must be positive and sum to the model's {num_layers} layers"
        )


def pipeline_generic(model: nn.Module, group: Any, split: list[int]) -> tuple[int, int]:
    """Pipeline ``model`` in place for this rank; returns its ``[start, end)``."""
    check_supported(model)
    owner, key = find_layers(model)
    layers = owner[key]
    rank, size = group.rank(), group.size()
    check_split(split, len(layers), size)
    start, end = layer_range(split, rank)
    if size == 1:
        return start, end
    exchange = Exchange()
    for i, layer in enumerate(layers):
        stage = _Stage(
            group=group,
            local=start <= i < end,
            recv_from=rank + 1 if i == start and rank < size - 1 else None,
            send_to=rank - 1 if i == end - 1 and rank > 0 else None,
            gather=i == len(layers) - 1,
            exchange=exchange,
        )
        if not stage.local:
            strip_weights(layer)
        # Every block is wrapped, inner local ones too: each records its output,
        # by which the next block's hidden state is recognised.
        layer.__class__ = _stage_class(type(layer))
        layer._mlxpipe_stage = stage
    return start, end


def find_exchange(model: nn.Module) -> Exchange | None:
    """The ``Exchange`` of a model ``pipeline_generic`` wrapped; None for one rank or native mode."""
    owner, key = find_layers(model)
    for layer in owner[key]:
        stage = getattr(layer, "_mlxpipe_stage", None)
        if stage is not None:
            return stage.exchange
    return None


_STAGE_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    """``cls`` with ``_PipelineStage`` in front; isinstance checks still hold."""
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_PipelineStage, cls), {})
    return _STAGE_CLASSES[cls]


def strip_weights(layer: nn.Module) -> None:
    """Remove the parameters of ``layer`` and its submodules, keep the rest."""
    for _, module in layer.named_modules():
        for key in list(module.keys()):
            if key.startswith("_"):
                continue  # private arrays (rope tables...) are not weights
            leaves = _leaves(module[key])
            if any(isinstance(v, mx.array) for v in leaves) and not any(
                isinstance(v, nn.Module) for v in leaves
            ):
                del module[key]


def _leaves(value: Any) -> list[Any]:
    """The leaves of ``value``, stopping at modules."""
    if isinstance(value, nn.Module):
        return [value]
    return [v for _, v in tree_flatten(value, is_leaf=lambda v: isinstance(v, nn.Module))]


def pipeline_native(model: nn.Module, group: Any, split: list[int]) -> tuple[int, int]:
    """Pipeline ``model`` with mlx-lm's own ``model.model.pipeline``."""
    if not has_native_pipeline(model):
        raise ModelError(
            f"{model_type_of(model)} has no native mlx-lm pipeline",
            hint="use the generic pipeline mode",
        )
    inner = model["model"]
    check_split(split, len(inner.layers), group.size())
    inner.pipeline(group, split)
    return inner.start_idx, inner.end_idx
