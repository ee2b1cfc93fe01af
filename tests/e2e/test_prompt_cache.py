"""The prompt cache's disk tier end to end: ``mlxpipe serve`` on 2 local ranks (a tiny float32 qwen2), stopped
and started again on the same cache directory.

The first server answers a conversation's first turn and writes each rank's slice of its caches; a second one,
on the same home (the default directory) and without a memory tier, answers the second turn from disk, as a
cold run would, and says so in ``cached_tokens`` and on the page; a slice truncated on one rank makes the next
hit a miss for every rank, and is removed. Twice: as a pipeline of two stages (each rank its own layers'
slice) and with ``--tp 2`` (one stage, each rank its own heads' slice).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fixtures.chat_reference import greedy, prompt
from fixtures.serve_process import ServeProcess, ready_server
from fixtures.tiny_models import TinyModels

pytestmark = pytest.mark.ranks

MAX_TOKENS = 12
# Long enough to be kept (worker.caches.disk_cache.MIN_TOKENS): the byte-level tokenizer makes a token of each byte.
SYSTEM = "You are a careful assistant who answers in short sentences and cites nothing. " * 6
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about rivers."}]
OTHER = [{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "Tell me about lakes."}]
WRITE_SECONDS = 60.0


def _chat(server: ServeProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=240)
    assert response.status_code == 200, response.text
    return response.json()


def _next_turn(messages: list[dict[str, str]], reply: dict[str, Any], text: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": text}]


def _cached(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _entries(folder: Path) -> dict[str, list[int]]:
    """A rank's kept prefixes: key -> tokens."""
    return {p.stem: json.loads(p.read_text())["tokens"] for p in folder.glob("*.json") if p.name != "slice.json"}


def _written(folders: list[Path], before: list[dict[str, list[int]]]) -> str:
    """Wait until every rank has written the one new entry a request leaves; its key (the same on each rank)."""
    deadline = time.monotonic() + WRITE_SECONDS
    while time.monotonic() < deadline:
        new = [sorted(set(_entries(f)) - set(b)) for f, b in zip(folders, before, strict=True)]
        if all(new):
            assert all(n == new[0] and len(n) == 1 for n in new), new  # each rank its own slice of one prefix
            return new[0][0]
        time.sleep(0.2)
    raise AssertionError(f"no new prompt cache entry on every rank in {WRITE_SECONDS:g} s: {folders}")


def _settled_health(server: ServeProcess) -> dict[str, Any]:
    """``/health`` once every rank but rank 0 counts the truncated slice's removal (or after ``WRITE_SECONDS``).
    Each rank reports its disk tier's figures as it ends a request, and the HTTP reply can come back before a
    rank other than rank 0 has told the server: CI saw rank 1's ``removed`` still 0 straight after the reply."""
    deadline = time.monotonic() + WRITE_SECONDS
    while True:
        health = server.health()
        if all(r["prompt_cache"]["removed"] >= 1 for r in health["ranks"][1:]) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def _folders(server: ServeProcess) -> list[Path]:
    return [Path(r["prompt_cache"]["dir"]) for r in server.health()["ranks"]]


@pytest.fixture(scope="module", params=[[], ["--tp", "2"]], ids=["pipeline", "tp"])
def runs(request: pytest.FixtureRequest, tiny_models: TinyModels,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both servers' answers, pages and files (one server after the other, on one home)."""
    model = tiny_models["qwen2"]
    home = tmp_path_factory.mktemp("prompt-cache-home")
    args = ["--model", str(model), "--hostfile", "hostfiles/local-2.json", *request.param]
    out: dict[str, Any] = {"model": model, "home": home, "tp": bool(request.param)}
    with ready_server(args, home) as first:
        out["folders"] = folders = _folders(first)
        out["first"] = _chat(first, FIRST)
        out["first_key"] = _written(folders, [{}, {}])
    with ready_server([*args, "--prompt-cache-size", "0"], home) as second:  # no memory tier: disk or nothing
        out["folders_again"] = _folders(second)
        out["second_messages"] = _next_turn(FIRST, out["first"], "And lakes?")
        before = [_entries(f) for f in folders]
        out["second"] = _chat(second, out["second_messages"])
        out["page"] = httpx.get(f"{second.url}/cluster", timeout=30).json()
        _written(folders, before)
        # One rank's slice truncated: its next use is a miss for every rank, and the file goes.
        before = [_entries(f) for f in folders]
        out["other"] = _chat(second, OTHER)
        key = _written(folders, before)
        out["truncated"] = truncated = folders[1] / f"{key}.safetensors"
        truncated.write_bytes(truncated.read_bytes()[:-64])
        out["intact"] = folders[0] / f"{key}.safetensors"
        out["other_messages"] = _next_turn(OTHER, out["other"], "Why?")
        out["other_second"] = _chat(second, out["other_messages"])
        out["entries_after"] = [_entries(f) for f in folders]
        out["truncated_key"] = key
        out["health"] = _settled_health(second)
    return out


def test_a_restarted_server_answers_the_second_turn_from_disk(runs: dict[str, Any]) -> None:
    first, second = runs["first"], runs["second"]
    assert _cached(first) == 0
    # From disk: all that the second prompt shares with what the first request fed (its prompt, and its reply
    # as far as the reply's text encodes back to the same tokens; a random model's bytes may not), less at most
    # the reply's last token, which is never fed.
    fed = [*prompt(runs["model"], FIRST), *greedy(runs["model"], FIRST, MAX_TOKENS)[1]]
    shared = _shared(fed, prompt(runs["model"], runs["second_messages"]))
    assert first["usage"]["prompt_tokens"] <= _cached(second) < second["usage"]["prompt_tokens"]
    assert shared - 1 <= _cached(second) <= shared
    # As a cold run: single-process mlx-lm on the whole conversation.
    expected = greedy(runs["model"], runs["second_messages"], MAX_TOKENS)[0]
    assert second["choices"][0]["message"]["content"] == expected


def test_the_page_counts_the_disk_hit(runs: dict[str, Any]) -> None:
    page, second = runs["page"], runs["second"]
    assert page["cache"]["tiers"] == {"memory": {"hits": 0, "cached_tokens": 0},
                                      "disk": {"hits": 1, "cached_tokens": _cached(second)}}
    assert page["cache"]["cached_tokens"] == _cached(second)
    latest = page["requests"][0]
    assert latest["cached_tokens"] == _cached(second) and latest["cache_tier"] == "disk"


def test_each_rank_keeps_its_own_slice_under_the_default_directory(runs: dict[str, Any]) -> None:
    folders = runs["folders"]
    assert runs["folders_again"] == folders  # the same split finds the same slices
    assert all(f.parent == runs["home"] / "mlxpipe" / "prompt-cache" for f in folders) and folders[0] != folders[1]
    slices = [json.loads((f / "slice.json").read_text()) for f in folders]
    assert [r["layers"] for r in runs["health"]["ranks"]] == [s["layers"] for s in slices]
    if runs["tp"]:  # the same layers, each rank its own heads
        assert slices[0]["layers"] == slices[1]["layers"] and [s["tp"] for s in slices] == [[0, 2], [1, 2]]
    else:
        # Other layers, each rank alone in its tensor group (its place in it 0, of 1).
        assert slices[0]["layers"] != slices[1]["layers"] and [s["tp"] for s in slices] == [[0, 1], [0, 1]]
    key = runs["first_key"]
    assert all((f / f"{key}.safetensors").is_file() for f in folders)
    tiers = [r["prompt_cache"] for r in runs["health"]["ranks"]]
    assert all(t["error"] is None and t["entries"] >= 1 and t["writes"] >= 1 for t in tiers), tiers


def test_a_truncated_slice_is_a_miss_for_every_rank_and_is_removed(runs: dict[str, Any]) -> None:
    reply = runs["other_second"]
    assert _cached(reply) == 0  # rank 0's slice was fine: no rank used it without rank 1's
    assert reply["choices"][0]["message"]["content"] == greedy(runs["model"], runs["other_messages"], MAX_TOKENS)[0]
    key = runs["truncated_key"]
    assert not runs["truncated"].exists() and key not in runs["entries_after"][1]
    assert runs["intact"].exists() and key in runs["entries_after"][0]
    assert runs["health"]["ranks"][1]["prompt_cache"]["removed"] >= 1
