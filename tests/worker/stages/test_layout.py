"""worker/stages/layout.py: what crosses a cut, packed with the hidden state."""

from __future__ import annotations


def test_extras_cross_a_cut_packed_with_the_hidden_state() -> None:
    """What a block returns besides the hidden state: arrays of its batch and tokens cross
    the cut (any dtype, alone or in tuples), the rest does not; one message holds them all."""
    import mlx.core as mx

    from mlxpipe.worker.stages.layout import (
        _layout_of,
        _made_up_extras,
        _pack,
        _unpack,
    )

    batch, tokens = 2, 7
    hidden = mx.random.normal((batch, tokens, 8))
    v_first = mx.random.normal((batch, tokens, 2, 3)).astype(mx.bfloat16)
    kv = (mx.random.normal((batch, tokens, 5)), mx.arange(batch * tokens, dtype=mx.int32).reshape(batch, tokens))
    cache_keys = mx.zeros((batch, 4, 9, 16))  # (batch, heads, cached tokens, ...): stays
    extras = (v_first, kv, cache_keys, 3, None)
    layout = _layout_of(hidden, extras)
    assert layout == {
        "hidden": {"shape": [8], "dtype": "float32"},
        "extras": [
            {"shape": [2, 3], "dtype": "bfloat16"},
            {"tuple": [{"shape": [5], "dtype": "float32"}, {"shape": [], "dtype": "int32"}]},
            None, None, None,
        ],
    }
    packed = _pack(layout, hidden, extras)
    assert packed.dtype == mx.uint8 and packed.shape == (batch, tokens, 4 * 8 + 2 * 6 + 4 * 5 + 4)
    got_hidden, got = _unpack(packed, layout)
    assert mx.array_equal(got_hidden, hidden)
    assert mx.array_equal(got[0], v_first) and got[0].dtype == mx.bfloat16
    assert all(mx.array_equal(a, b) for a, b in zip(got[1], kv, strict=True))
    assert got[2:] == [None, None, None]
    made_up = _made_up_extras(layout, hidden[:1, :3])
    assert [None if m is None else getattr(m, "shape", None) or [a.shape for a in m] for m in made_up] == [
        (1, 3, 2, 3), [(1, 3, 5), (1, 3)], None, None, None,
    ]
    assert _layout_of(hidden, None) is None  # a block that returns the hidden state alone
