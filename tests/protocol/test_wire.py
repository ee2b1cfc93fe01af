"""protocol/wire.py: the lines that carry messages to the ranks and events back, typed at both ends."""

from __future__ import annotations

import io

import pytest

from fixtures.protocol_samples import SAMPLES, name_of, registry_of
from mlxpipe.protocol import messages, wire
from mlxpipe.protocol.message import Event, Message


@pytest.mark.parametrize("sample", [s for s in SAMPLES if isinstance(s, messages.Message)], ids=name_of)
def test_messages_survive_the_lines_a_rank_reads(sample: Message) -> None:
    stream = io.StringIO(wire.encode(sample).decode())
    data = wire.read_request(stream)
    assert data is not None and messages.MESSAGES.from_wire(data) == sample
    assert wire.read_request(stream) is None  # the end of input


@pytest.mark.parametrize("sample", [s for s in SAMPLES if isinstance(s, Event)], ids=name_of)
def test_events_survive_a_rank_s_output(sample: Event) -> None:
    out = io.StringIO()
    print("plain output", file=out)
    wire.emit(sample, out)
    [data] = list(wire.iter_events(iter(out.getvalue().splitlines())))
    assert registry_of(sample).from_wire(data) == sample


def test_ordinary_output_and_other_json_are_no_events() -> None:
    assert wire.parse_event("loading the share") is None
    assert wire.parse_event(wire.EVENT_PREFIX + "[1, 2]") is None  # an event is an object
    assert wire.parse_event(wire.EVENT_PREFIX + "{cut") is None
    assert wire.parse_event("noise " + wire.EVENT_PREFIX + '{"event": "bye", "rank": 0}\r\n') == {"event": "bye",
                                                                                                   "rank": 0}
