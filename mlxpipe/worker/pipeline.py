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
* A block may return more than the hidden state (``(h, v_first)``): the extra
  arrays shaped like the state's batch and tokens cross the cut packed with it,
  and the stand-ins before the first local layer return zeros of their shapes,
  replaced by the received ones where the model passes them on
  (``learn_layouts`` finds out at load what crosses each cut).

Overlapped requests (``mlxpipe.worker.engine``) move hidden states
themselves, between micro-batches of different requests: with the rank's
``Exchange`` made explicit, the first local layer takes ``hidden_in``, the last
one leaves its output in ``hidden_out``, and nothing is sent or gathered.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, _BaseCache

from mlxpipe.errors import ModelError
from mlxpipe.worker.job import layer_range

# Architectures the generic pipeline cannot cut: what their layers hand each
# other is not arrays the size of the hidden state (a shared dict of growing
# state, residual-block objects, fused norms of the next rank's layer), or the
# model runs the stack in another way than once, block by block.
UNSUPPORTED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v41": "its layers hand compressed-KV state to later layers through a shared dict",
    "iquestloopcoder": "its model runs each block's attention itself, twice, instead of calling the blocks",
    "kimi_k3": "its layers pass an attention-residual object, not arrays, to the next layer",
    "muse_spark": "each block norms the next block's input with that block's weights, which the next rank holds",
    "nanbeige": "it runs the layer stack several times",
}


class Exchange:
    """How this rank's boundary layers move the hidden state; one per pipelined model.

    By default they receive, send and gather themselves, as one request's
    generation needs. ``explicit`` is for a loop that moves the states itself:
    the first local layer then takes ``hidden_in`` (or the incoming state as is
    when None, remembering its shape and dtype in ``incoming``), and the last
    local layer leaves its output in ``hidden_out``.

    Blocks that return more than the hidden state (``(h, v_first)``,
    ``(h, shared_kv_states)``...) hand the extra arrays on too: those shaped
    like the hidden state's batch and tokens travel packed with it, as one
    ``uint8`` array of shape ``(batch, tokens, bytes per token)`` (then
    ``hidden_in``/``hidden_out``/``incoming`` are that array). What a rank
    receives, ``incoming_layout``, is learnt once at load (``learn_layouts``).
    """

    def __init__(self) -> None:
        self.explicit = False
        self.hidden_in: mx.array | None = None
        self.hidden_out: mx.array | None = None
        self.incoming: tuple[tuple[int, ...], Any] | None = None
        # The last block's output in this forward pass: the next block's hidden state,
        # and what it returned besides (None when it returns the hidden state alone).
        self.last_out: mx.array | None = None
        self.last_extras: tuple | None = None
        # The layouts of what crosses the cut into and out of this rank (None: the
        # hidden state alone); ``probing`` while ``learn_layouts`` runs the model.
        self.incoming_layout: Layout | None = None
        self.outgoing_layout: Layout | None = None
        self.probing = False
        # Caches advanced by a stand-in in this forward pass: a KV-sharing layer is
        # handed its owner's cache, which must not advance twice.
        self.advanced: set[int] = set()
        # Where the hidden state keeps its tokens: (batch, tokens, ...) but for models
        # that stack several copies first (Gemma 3n's AltUp: (copies, batch, tokens, ...)).
        self.token_axis = 1


    def incoming_shape(self, num_tokens: int) -> tuple[tuple[int, ...], Any]:
        """The shape and dtype of what this rank receives for ``num_tokens`` tokens
        (``incoming`` noted for other counts)."""
        assert self.incoming is not None
        shape, dtype = self.incoming
        axis = 1 if self.incoming_layout is not None else self.token_axis  # packed: (batch, tokens, bytes)
        return (*shape[:axis], num_tokens, *shape[axis + 1 :]), dtype


@dataclass(frozen=True)
class _Stage:
    """What one entry of the layers list does around (or instead of) its layer."""

    group: Any
    index: int
    local: bool
    before_local: bool  # a stand-in for a layer before this rank's first
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
        if stage.index == 0:
            exchange.advanced.clear()  # a new forward pass
            if exchange.probing and _PROBE_TOKENS in x.shape:
                exchange.token_axis = list(x.shape).index(_PROBE_TOKENS)
        cache = _find_cache(args, kwargs)
        if stage.recv_from is not None and not exchange.probing:
            x, args, kwargs = _receive(stage, x, cache, args, kwargs)
        if stage.local:
            args, kwargs = _put_hidden(where, x, args, kwargs)
            out, extras = _split_output(self, super().__call__(*args, **kwargs))  # type: ignore[misc]
        else:
            if cache is not None and id(cache) not in exchange.advanced:
                exchange.advanced.add(id(cache))
                axis = exchange.token_axis
                advance_cache(cache, x.shape[axis - 1] if axis else 1, x.shape[axis])
            # A new array, not ``x`` itself: the next block must tell the state from
            # other arguments that were the same object (Talkie's embeddings).
            out = mx.stop_gradient(x)
            if stage.before_local:
                extras = _made_up_extras(exchange.incoming_layout, x)
            else:
                extras = exchange.last_extras
        if stage.send_to is not None:
            if exchange.probing:
                exchange.outgoing_layout = _layout_of(out, extras)
            else:
                out = _send(stage, out, extras, cache)
        if stage.gather and not exchange.explicit and not exchange.probing:
            out = mx.distributed.all_gather(out, group=stage.group)[: out.shape[0]]
        exchange.last_out, exchange.last_extras = out, extras
        return out if extras is None else (out, *extras)


def _split_output(layer: Any, out: Any) -> tuple[mx.array, tuple | None]:
    """A block's output as (hidden state, what it returned besides or None)."""
    if isinstance(out, mx.array):
        return out, None
    if isinstance(out, tuple) and out and isinstance(out[0], mx.array):
        return out[0], tuple(out[1:])
    raise ModelError(
        f"{type(layer).__name__} returns {type(out).__name__}, not a hidden state; "
        "the generic pipeline cannot cut this model"
    )


def _receive(stage: _Stage, x: mx.array, cache: Any, args: tuple, kwargs: dict) -> tuple[mx.array, tuple, dict]:
    """The first local layer's hidden state (and arguments) from rank + 1."""
    exchange = stage.exchange
    layout = exchange.incoming_layout
    like = x if layout is None else _packed_like(layout, x)
    if exchange.explicit:
        exchange.incoming = (tuple(like.shape), like.dtype)
        received = exchange.hidden_in
        if received is None:
            return x, args, kwargs
    else:
        received = mx.distributed.recv_like(like, stage.recv_from, group=stage.group)
        if cache is None:
            # Prefill evaluates only the caches: a receive no local cache
            # depends on would stay unread, and the next one would read it.
            mx.async_eval(received)
    if layout is None:
        return received, args, kwargs
    hidden, extras = _unpack(received, layout)
    # The extras the stand-in before made up are replaced wherever the model passes them on.
    for made_up, real in zip(exchange.last_extras or (), extras):
        if real is not None:
            args, kwargs = _replace_object(made_up, real, args, kwargs)
    return hidden, args, kwargs


def _send(stage: _Stage, out: mx.array, extras: tuple | None, cache: Any) -> mx.array:
    """Send what crosses the cut to rank - 1 (or leave it in ``hidden_out``); returns the hidden state."""
    exchange = stage.exchange
    layout = exchange.outgoing_layout
    message = out if layout is None else _pack(layout, out, extras)
    if exchange.explicit:
        exchange.hidden_out = message
        return out
    sent = mx.distributed.send(message, stage.send_to, group=stage.group)
    if cache is not None:
        tie_into_cache(cache, sent)
    else:
        # A block without a cache (an MLP or MoE block): prefill evaluates
        # only the caches, so nothing would run the send and the next rank
        # would wait forever. Schedule it now, without waiting for it.
        mx.async_eval(sent)
    return sent if layout is None else mx.depends(out, sent)


# ------------------------------------------------------- more than the hidden state

# A layout: the hidden state's and each extra output's trailing shape and dtype
# after (batch, tokens). An extra is an array, a tuple of arrays, or None for
# what does not cross the cut (other shapes, numbers, None itself).
Layout = dict[str, Any]
_PROBE_TOKENS = 7  # a length no head count or width is likely to equal
_HEADER_BYTES = 4096


def _array_layout(value: Any, lead: tuple[int, ...]) -> dict[str, Any] | None:
    if isinstance(value, mx.array) and tuple(value.shape[:2]) == lead:
        return {"shape": list(value.shape[2:]), "dtype": str(value.dtype).rsplit(".", 1)[-1]}
    return None


def _layout_of(out: mx.array, extras: tuple | None) -> Layout | None:
    """What of a block's output crosses the cut; None when only the hidden state does."""
    if extras is None:
        return None
    lead = tuple(out.shape[:2])
    items: list[Any] = []
    for value in extras:
        if isinstance(value, (tuple, list)) and value:
            parts = [_array_layout(v, lead) for v in value]
            items.append({"tuple": parts} if all(p is not None for p in parts) else None)
        else:
            items.append(_array_layout(value, lead))
    hidden = _array_layout(out, lead)
    if hidden is None:
        raise ModelError("a block returns more than a hidden state of shape (batch, tokens, ...); the generic pipeline cannot cut it")
    return {"hidden": hidden, "extras": items}


def _parts(layout: Layout) -> list[dict[str, Any]]:
    """The arrays of a message in order: the hidden state, then every extra's."""
    parts = [layout["hidden"]]
    for item in layout["extras"]:
        if item is not None:
            parts.extend(item["tuple"] if "tuple" in item else [item])
    return parts


def _dtype(name: str) -> Any:
    return getattr(mx, name)


def _width(part: dict[str, Any]) -> int:
    """Bytes per token of one part."""
    count = 1
    for n in part["shape"]:
        count *= n
    return count * _dtype(part["dtype"]).size


def _packed_like(layout: Layout, x: mx.array) -> mx.array:
    """A stand-in for the packed message of ``x``'s batch and tokens (for its shape)."""
    width = sum(_width(p) for p in _parts(layout))
    return mx.zeros((x.shape[0], x.shape[1], width), mx.uint8)


def _pack(layout: Layout, out: mx.array, extras: tuple | None) -> mx.array:
    """The hidden state and the extras that cross, as bytes per token, in one array:
    two sends could run in another order than the two receives."""
    arrays = [out]
    for item, value in zip(layout["extras"], extras or ()):
        if item is not None:
            arrays.extend(value if "tuple" in item else [value])
    batch, tokens = out.shape[:2]
    return mx.concatenate(
        [mx.contiguous(a).view(mx.uint8).reshape(batch, tokens, -1) for a in arrays], axis=2
    )


def _unpack(packed: mx.array, layout: Layout) -> tuple[mx.array, list[Any]]:
    """The hidden state and the extras (None where nothing crossed) from a packed message."""
    batch, tokens = packed.shape[:2]
    offset = 0

    def take(part: dict[str, Any]) -> mx.array:
        nonlocal offset
        width = _width(part)
        data = packed[:, :, offset : offset + width]
        offset += width
        return data.view(_dtype(part["dtype"])).reshape(batch, tokens, *part["shape"])

    hidden = take(layout["hidden"])
    extras: list[Any] = []
    for item in layout["extras"]:
        if item is None:
            extras.append(None)
        elif "tuple" in item:
            extras.append(tuple(take(p) for p in item["tuple"]))
        else:
            extras.append(take(item))
    return hidden, extras


def _made_up_extras(layout: Layout | None, x: mx.array) -> tuple | None:
    """What a stand-in before the first local layer returns besides the hidden state:
    zeros of the incoming extras' shapes, replaced by the received ones at the cut."""
    if layout is None:
        return None
    batch, tokens = x.shape[:2]

    def zeros(part: dict[str, Any]) -> mx.array:
        return mx.zeros((batch, tokens, *part["shape"]), _dtype(part["dtype"]))

    return tuple(
        None if item is None
        else tuple(zeros(p) for p in item["tuple"]) if "tuple" in item
        else zeros(item)
        for item in layout["extras"]
    )


def _replace_object(old: Any, new: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with the object ``old`` (by identity) replaced by ``new``."""
    args = tuple(new if a is old else a for a in args)
    kwargs = {k: new if v is old else v for k, v in kwargs.items()}
    return args, kwargs


def learn_layouts(model: nn.Module, group: Any) -> None:
    """Learn, once at load, what crosses each cut besides the hidden state.

    Rank by rank from the first stage: a rank hears from rank + 1 what it will
    receive, runs its layers lazily on a few tokens (nothing is evaluated) to
    see what its last layer returns, and tells rank - 1.
    """
    from mlx_lm.models.cache import make_prompt_cache

    exchange = find_exchange(model)
    if exchange is None:
        return
    rank, size = group.rank(), group.size()
    if rank < size - 1:
        header = mx.distributed.recv((_HEADER_BYTES,), mx.uint8, rank + 1, group=group, stream=mx.cpu)
        try:
            exchange.incoming_layout = json.loads(bytes(np.array(header)).rstrip(b"\0") or b"null")
        except ValueError:  # UnicodeDecodeError included: the ring hands over what it got
            # A peer that died before sending leaves garbage here: a consequence, not the root cause.
            raise RuntimeError(f"no layout from rank {rank + 1}: connection to a peer was lost") from None
    exchange.probing = True
    try:
        model(mx.zeros((1, _PROBE_TOKENS), mx.int32), cache=make_prompt_cache(model))
    finally:
        exchange.probing = False
        exchange.last_out = exchange.last_extras = None
    if rank > 0:
        text = json.dumps(exchange.outgoing_layout).encode()
        if len(text) > _HEADER_BYTES:
            raise ModelError("the blocks of this model return too many arrays to pipeline")
        data = mx.array(np.frombuffer(text.ljust(_HEADER_BYTES, b"\0"), dtype=np.uint8))
        mx.eval(mx.distributed.send(data, rank - 1, group=group, stream=mx.cpu))


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


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in the order it runs them.

    The list ``find_layers`` finds; else what ``model.layers`` returns, when
    that joins several lists (AFM's blocks, then its KV-reuse blocks): the
    pipeline wraps the block objects themselves, wherever they are kept.
    """
    try:
        owner, key = find_layers(model)
    except ModelError:
        joined = getattr(model, "layers", None)
        if _is_layer_list(joined):
            return joined
        raise
    return owner[key]


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
        native = has_native_pipeline(model)
        raise ModelError(
            f"mlxpipe cannot pipeline {model_type_of(model)}: {reason}",
            hint="run it with --pipeline native (mlx-lm's own pipeline for it; one request at a time)"
            if native else "run it on one machine with mlx_lm.generate",
        )
    blocks_of(model)


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
    layers = blocks_of(model)
    rank, size = group.rank(), group.size()
    check_split(split, len(layers), size)
    start, end = layer_range(split, rank)
    if size == 1:
        return start, end
    exchange = Exchange()
    for i, layer in enumerate(layers):
        stage = _Stage(
            group=group,
            index=i,
            local=start <= i < end,
            before_local=i < start,
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
    for layer in blocks_of(model):
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
