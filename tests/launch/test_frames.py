"""Events through mlx.launch's merged output: frames that survive being cut (``mlxpipe.launch.frames``).

mlx.launch reads each rank's output in pieces of at most 8 KiB and writes every
rank's pieces to one stream as they come. The pure tests cut and merge streams
the way it does (and worse); the launch tests flood real mlx.launch runs, on
this machine and over the ssh cluster, with events many times that size.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.flood import check_flood, flood
from mlxpipe.launch import frames

READ = 8192  # what mlx.launch reads of a rank's pipe at once
# Random bytes to the characters frames must escape or may confuse with their own, and plain letters.
TEXT = bytes(b'ab@#:{}" \\'[i % 10] for i in range(256))


def rank_events(rng: random.Random, rank: int, count: int, big: float) -> list[dict[str, Any]]:
    events = []
    for i in range(count):
        size = rng.randint(5000, 60000) if rng.random() < big else rng.randint(1, 300)
        text = rng.randbytes(size).translate(TEXT).decode()
        events.append({"event": rng.choice(["token", "alive", "log", "done"]), "rank": rank, "i": i, "text": text})
    return events


def reads(rng: random.Random, events: list[dict[str, Any]], rank: int, small: float) -> list[str]:
    """The pieces mlx.launch reads of one rank's frames: 8 KiB when the rank is ahead, what is there
    when not (whole frames), and with probability ``small`` a piece of any size (a frame half-written)."""
    data, seq = [], 0
    for event in events:
        lines = frames.encode(event, rank, seq)
        seq += len(lines)
        data += lines
    stream, pieces, at = "".join(data), [], 0
    while at < len(stream):
        if rng.random() < small:
            n = rng.randint(1, READ)
        elif rng.random() < 0.5:
            n = READ
        else:
            end = stream.find("\n", at + rng.randint(0, 3000))
            n = min(READ, (end + 1 - at) if end >= 0 else len(stream) - at)
        pieces.append(stream[at : at + n])
        at += n
    return pieces


def merged(rng: random.Random, per_rank: list[list[str]]) -> str:
    """mlx.launch's main loop: each turn, every rank's queued pieces in rank order."""
    queues, out = [list(p) for p in per_rank], []
    while any(queues):
        for queue in queues:
            for _ in range(min(rng.choice([0, 0, 1, 1, 2]), len(queue))):
                out.append(queue.pop(0))
    return "".join(out)


def demux(stream: str) -> list[frames.Item]:
    d = frames.Demux()
    items: list[frames.Item] = []
    for line in stream.splitlines(keepends=True):
        items += d.feed(line)
    return items + d.close()


def scenario(seed: int, ranks: int, big: float, small: float) -> tuple[list[list[dict[str, Any]]], list[frames.Item]]:
    rng = random.Random(seed)
    sent = [rank_events(rng, r, 150, big) for r in range(ranks)]
    return sent, demux(merged(rng, [reads(rng, events, r, small) for r, events in enumerate(sent)]))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("big", [0.0, 0.1])
def test_every_event_is_put_back_from_mlx_launch_pieces(ranks: int, big: float) -> None:
    for seed in range(8):
        sent, items = scenario(seed, ranks, big, small=0.0)
        assert [i for i in items if not isinstance(i, dict) or i["event"] == "lost"] == [], seed
        for rank in range(ranks):
            assert [e for e in items if isinstance(e, dict) and e["rank"] == rank] == sent[rank], (seed, rank)


@pytest.mark.parametrize(("seed", "ranks", "big"), [
    (18, 2, 0.0),  # a frame cut inside its header, then the rest of another one cut there earlier: a "header"
    (14, 4, 0.0),  # ... that is neither frame's (the rest completes the piece set aside)
    (12, 4, 0.0),  # two starts set aside ("@@ml", "@@mlx") that one rest completes: its rank's order tells them apart
    (22, 4, 0.0),  # a start set aside as "@", whose rest the line's search took as a whole header with the "@" of
    (3, 4, 0.1),   # ... the piece before it: that piece's frame takes the "@" back when its rest comes
])
def test_cuts_that_once_lost_frames_are_put_back(seed: int, ranks: int, big: float) -> None:
    sent, items = scenario(seed, ranks, big, small=0.0)
    assert [i for i in items if not isinstance(i, dict) or i["event"] == "lost"] == []
    for rank in range(ranks):
        assert [e for e in items if isinstance(e, dict) and e["rank"] == rank] == sent[rank], rank


@pytest.mark.parametrize("ranks", [2, 4])
def test_pieces_of_any_size_are_never_garbled_and_every_loss_is_reported(ranks: int) -> None:
    for seed in range(6):
        sent, items = scenario(seed, ranks, big=0.2, small=0.2)
        events = [e for e in items if isinstance(e, dict) and e["event"] != "lost"]
        lost = {e["rank"] for e in items if isinstance(e, dict) and e["event"] == "lost"}
        assert len(events) > 0.8 * ranks * 150
        for rank in range(ranks):
            got = [e for e in events if e["rank"] == rank]
            assert all(e == sent[rank][e["i"]] for e in got), (seed, rank)  # intact
            assert [e["i"] for e in got] == sorted({e["i"] for e in got})  # in order, once
            if len(got) < len(sent[rank]):
                assert rank in lost, (seed, rank)


def test_a_long_event_travels_in_frames_below_a_pipes_atomic_write() -> None:
    event = {"event": "adapter", "rank": 1, "data": "x" * 100_000 + 'é"\\'}
    lines = frames.encode(event, 1, 0)
    assert len(lines) == 29 and all(len(line.encode()) < 4096 for line in lines)
    assert demux("".join(lines)) == [event]
    # A frame's header and payload are both checked: one character changed anywhere, and it is refused.
    changed = lines[3].replace("#1:3:", "#1:4:")
    assert demux("".join(lines[:3] + [changed] + lines[4:]))[0] == {
        "event": "lost", "rank": 1, "frames": 1, "critical": True}


def test_plain_output_passes_as_text_and_a_lost_heartbeat_is_not_critical() -> None:
    alive = frames.encode({"event": "alive", "rank": 0}, 0, 0)[0]
    token = frames.encode({"event": "token", "rank": 0, "text": "hi"}, 0, 1)[0]
    items = demux("\x1b[33m[WARN] Node with rank 1 exited with code 1\x1b[0m\n" + alive[:45] + "\n" + token)
    assert items == ["\x1b[33m[WARN] Node with rank 1 exited with code 1\x1b[0m",
                     {"event": "lost", "rank": 0, "frames": 1, "critical": False},
                     {"event": "token", "rank": 0, "text": "hi"}]
    frame = frames.encode({"event": "token", "rank": 2}, 2, 5)[0]
    assert demux(frame) == [{"event": "lost", "rank": 2, "frames": 5, "critical": True},  # 0-4 never came
                            {"event": "token", "rank": 2}]


# --- Real mlx.launch runs ------------------------------------------------------------------------


@pytest.mark.ranks
def test_a_flood_of_long_events_from_every_rank_arrives_whole(tmp_path: Path) -> None:
    hostfile = tmp_path / "local-3.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3))
    tic = time.monotonic()
    check_flood(flood(hostfile, 2000), 2000)  # ~21 MB per rank: events of 20 B to 65 KB
    print(f"flood: {time.monotonic() - tic:.1f} s")
