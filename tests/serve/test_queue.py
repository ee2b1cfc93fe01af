"""serve/queue.py: the request log's totals, per tier of the prompt cache; requests resumed after their ranks failed."""

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


def test_requests_in_flight_when_the_ranks_fail_go_on_after_the_reply_so_far() -> None:
    """The queue alone (no rank): the ranks fail while two requests run and one waits for a slot. Once the
    relaunched ranks serve, the running ones are sent again first, each with its reply so far after its prompt and
    its seed kept; the client's stream gets no error, and the usage counts the replayed tokens as the reply's."""
    import asyncio
    from types import SimpleNamespace

    from mlxpipe.errors import LaunchError
    from mlxpipe.protocol.events import Finished, Serving, Token
    from mlxpipe.protocol.messages import Submit
    from mlxpipe.protocol.request import Request
    from mlxpipe.serve.queue import RequestQueue, ServeOptions
    from mlxpipe.serve.stream import Outcome

    loop = asyncio.new_event_loop()
    plan = SimpleNamespace(ranks=[SimpleNamespace(rank=0, host="h", start=0, end=2)])
    queue = RequestQueue(None, None, plan, ServeOptions(max_concurrency=2))  # type: ignore[arg-type]
    sent: list[Submit] = []
    queue._pipe = SimpleNamespace(ranks=SimpleNamespace(send=sent.append))  # type: ignore[assignment]
    queue.state = "ready"
    greedy = queue.submit(Request(tokens=[1, 2, 3], max_tokens=6, id="a"), loop)
    sampled = queue.submit(Request(tokens=[4, 5], max_tokens=6, temp=0.7, id="b"), loop)
    for token in (10, 11):
        queue._dispatch(Token(rank=0, id="a", token=token))
    queue._dispatch(Token(rank=0, id="b", token=20))
    seed = sent[1].request.seed
    assert seed is not None  # given one at its first sending
    queue.state = "restarting"
    late = queue.submit(Request(tokens=[6], max_tokens=2, id="c"), loop)

    queue._resume_or_fail(LaunchError("rank 1 on h: killed by SIGKILL (exit status -9)"))
    queue._pipe = SimpleNamespace(ranks=SimpleNamespace(send=sent.append))  # type: ignore[assignment]
    del sent[:]
    queue._dispatch(Serving(rank=0, concurrency=2, decode_batch=1))
    assert [(m.request.id, m.request.tokens, m.request.max_tokens, m.request.resumed, m.request.seed)
            for m in sent] == [("a", [1, 2, 3, 10, 11], 4, 2, None), ("b", [4, 5, 20], 5, 1, seed),
                               ("c", [6], 2, 0, None)]
    queue._dispatch(Token(rank=0, id="a", token=12))
    queue._dispatch(Finished(rank=0, id="a", finish_reason="stop", prompt_tokens=5, cached_tokens=3,
                             generation_tokens=1))
    loop.run_until_complete(asyncio.sleep(0))  # the stream's items, put from this thread, are delivered

    async def drain() -> list[object]:
        return [await greedy.next() for _ in range(4)]

    items = loop.run_until_complete(drain())
    assert items[:3] == [10, 11, 12]
    outcome = items[3]
    assert isinstance(outcome, Outcome) and outcome.error is None
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.generation_tokens) == (3, 3, 3)
    (resumed,) = greedy.resumed
    assert (resumed.replayed, resumed.cause) == (2, "rank 1 on h: killed by SIGKILL (exit status -9)")
    assert resumed.pause is not None and "2 tokens replayed" in resumed.describe()
    assert late.resumed == [] and sampled.resumed[0].pause is None  # waiting was no failure; b has no token since
    loop.close()


def test_a_request_resumed_too_often_or_with_resume_off_ends_with_the_root_cause() -> None:
    import asyncio
    from types import SimpleNamespace

    from mlxpipe.errors import LaunchError
    from mlxpipe.protocol.request import Request
    from mlxpipe.serve.queue import MAX_RESUMES, RequestQueue, ServeOptions

    loop = asyncio.new_event_loop()
    plan = SimpleNamespace(ranks=[])
    for options, failures in ((ServeOptions(max_concurrency=1), MAX_RESUMES + 1),
                              (ServeOptions(max_concurrency=1, resume_timeout=0), 1)):
        queue = RequestQueue(None, None, plan, options)  # type: ignore[arg-type]
        queue._pipe = SimpleNamespace(ranks=SimpleNamespace(send=lambda m: None))  # type: ignore[assignment]
        queue.state = "ready"
        stream = queue.submit(Request(tokens=[1], id="a"), loop)
        error = LaunchError("rank 1 on h: killed by SIGKILL (exit status -9)")
        for _ in range(failures):
            queue._resume_or_fail(error)
            with queue._lock:
                queue._waiting.clear()  # as if sent again: running once more
        assert queue.in_flight == 0
        loop.run_until_complete(asyncio.sleep(0))
        outcome = loop.run_until_complete(stream.next())
        assert outcome.error is error  # type: ignore[union-attr]
    loop.close()


def test_the_wait_before_a_relaunch_grows_with_failures_in_a_row_and_starts_again_after_a_stable_run() -> None:
    from types import SimpleNamespace

    from mlxpipe.serve.queue import STABLE_SECONDS, RequestQueue, ServeOptions

    queue = RequestQueue(None, None, SimpleNamespace(ranks=[]), ServeOptions(max_concurrency=1))  # type: ignore[arg-type]
    waits = []
    for served in (STABLE_SECONDS + 1, 0.5, 0.5, 0.5, STABLE_SECONDS + 1, 0.5):
        queue._set_state("ready", None)
        queue._ready_since -= served  # type: ignore[operator]  # as if it had been ready that long
        waits.append(queue._backoff())
    assert waits == [1.0, 2.0, 5.0, 10.0, 1.0, 2.0]
    assert queue._backoff() == 5.0  # failed again before it was ever ready: still in a row
