"""serve/queue.py: the request log's totals, per tier of the prompt cache."""

from __future__ import annotations

from mlxpipe.serve.queue import RequestLog


def test_the_log_counts_each_tiers_hits() -> None:
    log = RequestLog()
    log.write({"id": "a", "prompt_tokens": 500, "cached_tokens": 0, "cache_tier": None})
    log.write({"id": "b", "prompt_tokens": 520, "cached_tokens": 480, "cache_tier": "disk"})
    log.write({"id": "c", "prompt_tokens": 540, "cached_tokens": 500, "cache_tier": "memory"})
    log.write({"id": "d", "prompt_tokens": 10, "cached_tokens": 0, "cache_tier": None})
    requests, totals = log.figures()
    assert [r["id"] for r in requests] == ["d", "c", "b", "a"]
    assert totals == {"requests": 4, "refused": 0, "hits": 2, "cached_tokens": 980, "prompt_tokens": 1570,
                      "tiers": {"memory": {"hits": 1, "cached_tokens": 500}, "disk": {"hits": 1, "cached_tokens": 480}}}
