"""serve/responses_store.py: the stored responses, bounded in number, bytes and time."""

from __future__ import annotations

from mlxpipe.serve.responses_store import ResponseStore


def test_the_store_is_bounded_in_number_bytes_and_time() -> None:
    now = [0.0]
    store = ResponseStore(capacity=2, ttl=10, max_bytes=1000, clock=lambda: now[0])
    for name in "abc":
        store.put(name, [], {})
    assert (store.get("a"), len(store)) == (None, 2)  # the oldest went
    now[0] = 11
    assert store.get("b") is None and store.get("c") is None  # expired
    by_size = ResponseStore(capacity=10, max_bytes=1000)
    for name in "bc":
        by_size.put(name, [], {})
    by_size.put("big", [{"content": "x" * 990}], {})
    assert (by_size.get("b"), by_size.get("c"), len(by_size)) == (None, None, 1)  # over 1000 bytes: the others went
