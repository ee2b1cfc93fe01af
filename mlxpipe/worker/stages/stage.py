"""The wrapper around each block of a cut model, and the hand-over of the hidden state at the cut.

See the package docstring: stand-ins pass the hidden state through, the first
local layer receives it from the stage before (stage + 1), the last one sends
it to the next (stage - 1), through the rank's ``Topology`` (with tensor
groups, over the neighbouring members).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from mlxpipe.errors import ModelError
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.stages.caches import advance_cache, tie_into_cache
from mlxpipe.worker.stages.layout import (
    _PROBE_TOKENS,
    Layout,
    _layout_of,
    _made_up_extras,
    _pack,
    _packed_like,
    _unpack,
)

# A block's call, whatever the model passes it: its own signature is open.
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


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
        self.incoming: tuple[tuple[int, ...], mx.Dtype] | None = None
        # The last block's output in this forward pass: the next block's hidden state,
        # and what it returned besides (None when it returns the hidden state alone).
        self.last_out: mx.array | None = None
        self.last_extras: Args | None = None
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


    def incoming_shape(self, num_tokens: int) -> tuple[tuple[int, ...], mx.Dtype]:
        """The shape and dtype of what this rank receives for ``num_tokens`` tokens
        (``incoming`` noted for other counts)."""
        assert self.incoming is not None
        shape, dtype = self.incoming
        axis = 1 if self.incoming_layout is not None else self.token_axis  # packed: (batch, tokens, bytes)
        return (*shape[:axis], num_tokens, *shape[axis + 1 :]), dtype


@dataclass(frozen=True)
class _Stage:
    """What one entry of the layers list does around (or instead of) its layer."""

    topology: Topology
    index: int
    local: bool
    before_local: bool  # a stand-in for a layer before this rank's first
    receives: bool  # the first local layer of a stage after the first: from stage + 1
    sends: bool  # the last local layer of a stage before the last: to stage - 1
    gather: bool
    exchange: Exchange

    @property
    def group(self) -> mx.distributed.Group:
        """The job's world group."""
        return self.topology.world


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
        if stage.receives and not exchange.probing:
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
            extras = _made_up_extras(exchange.incoming_layout, x) if stage.before_local else exchange.last_extras
        if stage.sends:
            if exchange.probing:
                exchange.outgoing_layout = _layout_of(out, extras)
            else:
                out = _send(stage, out, extras, cache)
        if stage.gather and not exchange.explicit and not exchange.probing:
            # Every rank keeps world rank 0's part: the same logits (and token) everywhere.
            out = mx.distributed.all_gather(out, group=stage.topology.world)[: out.shape[0]]
        exchange.last_out, exchange.last_extras = out, extras
        return out if extras is None else (out, *extras)


def _split_output(layer: Any, out: Any) -> tuple[mx.array, Args | None]:
    """A block's output as (hidden state, what it returned besides or None)."""
    if isinstance(out, mx.array):
        return out, None
    if isinstance(out, tuple) and out and isinstance(out[0], mx.array):
        return out[0], tuple(out[1:])
    raise ModelError(
        f"{type(layer).__name__} returns {type(out).__name__}, not a hidden state; "
        "the generic pipeline cannot cut this model"
    )


def _receive(stage: _Stage, x: mx.array, cache: Any, args: Args, kwargs: Kwargs) -> tuple[mx.array, Args, Kwargs]:
    """The first local layer's hidden state (and arguments) from stage + 1."""
    exchange = stage.exchange
    layout = exchange.incoming_layout
    like = x if layout is None else _packed_like(layout, x)
    if exchange.explicit:
        exchange.incoming = (tuple(like.shape), like.dtype)
        received = exchange.hidden_in
        if received is None:
            return x, args, kwargs
    else:
        received = stage.topology.recv_up_like(like)
        if cache is None:
            # Prefill evaluates only the caches: a receive no local cache
            # depends on would stay unread, and the next one would read it.
            mx.async_eval(received)
    if layout is None:
        return received, args, kwargs
    hidden, extras = _unpack(received, layout)
    # The extras the stand-in before made up are replaced wherever the model passes them on.
    for made_up, real in zip(exchange.last_extras or (), extras, strict=False):
        if real is not None:
            args, kwargs = _replace_object(made_up, real, args, kwargs)
    return hidden, args, kwargs


def _send(stage: _Stage, out: mx.array, extras: Args | None, cache: Any) -> mx.array:
    """Send what crosses the cut to stage - 1 (or leave it in ``hidden_out``); returns the hidden state."""
    exchange = stage.exchange
    layout = exchange.outgoing_layout
    message = out if layout is None else _pack(layout, out, extras)
    if exchange.explicit:
        exchange.hidden_out = message
        return out
    sent = stage.topology.send_down(message)
    if cache is not None:
        tie_into_cache(cache, sent)
    else:
        # A block without a cache (an MLP or MoE block): prefill evaluates
        # only the caches, so nothing would run the send and the next rank
        # would wait forever. Schedule it now, without waiting for it.
        mx.async_eval(sent)
    return sent if layout is None else cast(mx.array, mx.depends(out, sent))  # mlx leaves depends() unannotated


def _replace_object(old: object, new: object, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """The call's arguments with the object ``old`` (by identity) replaced by ``new``."""
    args = tuple(new if a is old else a for a in args)
    kwargs = {k: new if v is old else v for k, v in kwargs.items()}
    return args, kwargs


def _find_hidden(layer: object, args: Args, kwargs: Kwargs, previous: mx.array | None) -> tuple[int | str, mx.array]:
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
    first = _first_parameter(type(layer).__mro__[2])  # the class behind the pipeline mixin
    if first is not None and first in kwargs:
        return first, kwargs[first]
    raise ModelError("a layer was called without a hidden state the pipeline can find")


def _put_hidden(where: int | str, x: mx.array, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
    """The call's arguments with the hidden state at ``where`` replaced by ``x``."""
    if isinstance(where, int):
        return args[:where] + (x,) + args[where + 1 :], kwargs
    return args, {**kwargs, where: x}


@cache
def _first_parameter(cls: type) -> str | None:
    """The name of the first parameter of ``cls.__call__`` after ``self``."""
    try:
        params = list(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return None
    return params[1] if len(params) > 1 else None


def _find_cache(args: Args, kwargs: Kwargs) -> Any:
    """The cache object passed to a layer call, None when there is none."""
    if kwargs.get("cache") is not None:
        return kwargs["cache"]
    for value in (*args, *kwargs.values()):
        if isinstance(value, cache_types()):
            return value
    return None


def cache_types() -> tuple[type, ...]:
    """mlx-lm's caches, and mlx-vlm's (its own classes of the same shape) once a vision-language model loaded it:
    a rank that never imported mlx-vlm holds none of its caches, and a text model's rank never pays its import."""
    module = sys.modules.get("mlx_vlm.models.cache")
    vision_cache = getattr(module, "_BaseCache", None)
    return (_BaseCache,) if vision_cache is None else (_BaseCache, vision_cache)


_STAGE_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    """``cls`` with ``_PipelineStage`` in front; isinstance checks still hold."""
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_PipelineStage, cls), {})
    return _STAGE_CLASSES[cls]
