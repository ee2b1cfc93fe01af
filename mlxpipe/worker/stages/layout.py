"""What crosses a cut besides the hidden state, and how it is packed into one message.

A block may return more than the hidden state (``(h, v_first)``): the extra
arrays shaped like the state's batch and tokens cross the cut packed with it,
as bytes per token, in one ``uint8`` array.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxpipe.errors import ModelError

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


def _layout_of(out: mx.array, extras: tuple[Any, ...] | None) -> Layout | None:
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
        raise ModelError(
            "a block returns more than a hidden state of shape (batch, tokens, ...); the generic pipeline cannot cut it"
        )
    return {"hidden": hidden, "extras": items}


def _parts(layout: Layout) -> list[dict[str, Any]]:
    """The arrays of a message in order: the hidden state, then every extra's."""
    parts = [layout["hidden"]]
    for item in layout["extras"]:
        if item is not None:
            parts.extend(item.get("tuple", [item]))
    return parts


def _dtype(name: str) -> mx.Dtype:
    dtype: mx.Dtype = getattr(mx, name)
    return dtype


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


def _pack(layout: Layout, out: mx.array, extras: tuple[Any, ...] | None) -> mx.array:
    """The hidden state and the extras that cross, as bytes per token, in one array:
    two sends could run in another order than the two receives."""
    arrays = [out]
    for item, value in zip(layout["extras"], extras or (), strict=False):
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


def _made_up_extras(layout: Layout | None, x: mx.array) -> tuple[Any, ...] | None:
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
