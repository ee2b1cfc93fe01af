"""protocol/message.py: every message and event (``protocol.messages``, ``protocol.events``, ``protocol.fetch_events``)
survives the wire, and a field one side does not know, or lacks, is refused naming the message and the field."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

import pytest

from fixtures.protocol_samples import REGISTRIES, SAMPLES, name_of, registry_of
from mlxpipe.errors import UsageError, WireError
from mlxpipe.protocol import events, messages
from mlxpipe.protocol.message import Wired


def test_every_message_and_event_has_a_sample() -> None:
    """A new message or event must get a sample in ``fixtures/protocol_samples.py``, so that it is tested too."""
    classes = {cls for registry in REGISTRIES for cls in registry.classes.values()}
    assert classes == {type(s) for s in SAMPLES}


@pytest.mark.parametrize("sample", SAMPLES, ids=name_of)
def test_every_message_and_event_survives_the_wire(sample: Wired) -> None:
    data = json.loads(json.dumps(sample.to_wire()))  # as the other side reads it
    assert data[sample.KEY] == sample.TAG
    assert registry_of(sample).from_wire(data) == sample
    assert type(sample).from_wire(data) == sample


@pytest.mark.parametrize("sample", SAMPLES, ids=name_of)
def test_a_field_this_side_does_not_know_is_refused_by_name(sample: Wired) -> None:
    data = {**sample.to_wire(), "temperature": 1}
    with pytest.raises(WireError) as info:
        registry_of(sample).from_wire(data)
    assert "temperature" in info.value.message
    # Requests say "the request", as they always have; the others name their kind.
    assert ("the request" if isinstance(sample, (messages.Generate, messages.Submit)) else repr(sample.TAG)) \
        in info.value.message
    assert info.value.hint == "install the same mlxpipe version on every host"


def _required(sample: Wired) -> list[str]:
    return [f.name for f in fields(sample) if f.default is MISSING and f.default_factory is MISSING  # type: ignore[arg-type]
            and f.name != "request"]  # a request's fields all have defaults


@pytest.mark.parametrize("sample", [s for s in SAMPLES if _required(s)], ids=name_of)
def test_a_field_this_side_lacks_is_refused_by_name(sample: Wired) -> None:
    for name in _required(sample):
        data = sample.to_wire()
        del data[name]
        with pytest.raises(WireError, match=rf"the {sample.TAG!r} {sample.NOUN} lacks the field {name}$"):
            registry_of(sample).from_wire(data)


def test_a_field_left_out_takes_the_dataclass_default_only_where_it_has_one() -> None:
    assert events.Exited.from_wire({"event": "exited", "rank": 1, "returncode": 0}) == events.Exited(1, 0)
    batch = {"type": "batch", "requests": [{"prompt": "x"}], "concurrency": 2}
    assert messages.Batch.from_wire(batch).decode_batch == 1
    with pytest.raises(WireError, match=r"the 'serve' message lacks the field concurrency$"):
        messages.Serve.from_wire({"type": "serve"})
    with pytest.raises(WireError, match=r"the 'save' message lacks the fields id, it, checkpoint$"):
        messages.MESSAGES.from_wire({"type": "save"})


def test_a_kind_this_side_does_not_know_is_refused() -> None:
    with pytest.raises(WireError, match="this worker does not know the message 'generate_fast'"):
        messages.MESSAGES.from_wire({"type": "generate_fast"})
    with pytest.raises(WireError, match="this controller does not know the event 'flood'"):
        events.EVENTS.from_wire({"event": "flood", "rank": 0})
    with pytest.raises(WireError, match="names no 'type'"):
        messages.MESSAGES.from_wire({"prompt": "x"})
    # A training rank's done is not a serving rank's: each stream has its own.
    with pytest.raises(WireError, match="this controller does not know the event 'adapter'"):
        events.EVENTS.from_wire(events.Adapter(id=1, rank=0, data="").to_wire())
    with pytest.raises(WireError, match="a 'done' event read as a 'token' one"):
        events.Token.from_wire(events.Bye(rank=0).to_wire() | {"event": "done"})


@pytest.mark.parametrize("message, error", [
    ({"type": "batch", "requests": [], "concurrency": 1}, "a batch request needs at least one request"),
    ({"type": "batch", "requests": [{"prompt": "x"}], "concurrency": 0}, "concurrency must be at least 1, got 0"),
    ({"type": "serve", "concurrency": 2, "decode_batch": 0}, "decode_batch must be at least 1, got 0"),
])
def test_a_message_no_rank_could_run_is_refused(message: dict[str, Any], error: str) -> None:
    with pytest.raises(UsageError, match=error):
        messages.MESSAGES.from_wire(message)
