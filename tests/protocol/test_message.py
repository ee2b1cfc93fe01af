"""protocol/message.py: every message and event (``protocol.messages``, ``protocol.events``, ``protocol.download``)
survives the wire, and a field one side does not know, or lacks, is refused naming the message and the field."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

import pytest

from mlxpipe.errors import UsageError, WireError
from mlxpipe.launch.failures import TRACKED, NodeExit
from mlxpipe.protocol import download, events, messages
from mlxpipe.protocol.message import Registry, Wired
from mlxpipe.protocol.request import Request

# One of each message and event, its optional fields set where they have any.
SAMPLES: list[Wired] = [
    messages.Generate(Request(prompt="x", temp=0.5, seed=3, logit_bias={7: -1.5}, extra_eos_token=("<eos>",))),
    messages.Batch((Request(prompt="a", id=1), Request(messages=[{"role": "user", "content": "b"}])), 4, 2),
    messages.Serve(concurrency=8, decode_batch=4, prompt_cache_size=10),
    messages.Submit(Request(tokens=[1, 2, 3], id="req-1", max_tokens=5, logprobs=True, top_logprobs=2)),
    messages.Cancel("req-1"),
    messages.Exit(),
    messages.Resume(id=1, data="AAAA"),
    messages.Step(id=2, it=1, batch=[[1, 2, 3]], lengths=[[0, 3]], micro_batches=1, schedule="1f1b"),
    messages.Eval(id=3, it=None, what="test", batches=[([[1, 2]], [[0, 2]])]),
    messages.Save(id=4, it=1, checkpoint=True),
    events.Started(rank=1, pid=100, supervisor=99),
    events.Alive(rank=1),
    events.Exited(rank=1, returncode=-9, signal="SIGKILL", stopped=None, finished=False),
    events.Log(rank=0, text="hello", stream="stderr"),
    events.Lost(rank=1, frames=2, critical=True),
    events.Error(rank=1, type="ModelError", message="no config.json", hint="copy it", host="h", traceback="T",
                 time=1.5),
    events.Progress(rank=0, what="decode token 4", step=7),
    events.Bye(rank=0, host="h"),
    events.Loaded(rank=0, host="h", layers=[3, 6], num_layers=6, mode="generic", peak_memory=0.5, load_seconds=1.2,
                  trainable=10, frozen=90),
    events.Token(rank=0, token=5, id="req-1", text="hi", logprob=-0.5, top=[[5, -0.5], [6, -1.0]]),
    events.Done(rank=0, finish_reason="stop", tokens=[5, 2], generation_tokens=2, peak_memory=0.5, prompt_tokens=7,
                cached_tokens=3, prompt_tps=10.0, generation_tps=20.0, ttft=0.1, draft_tokens=1, error=None, id="a"),
    events.Result(rank=0, index=0, id=1, tokens=[5], text="hi", prompt_tokens=3, generation_tokens=1,
                  finish_reason="length", ttft=0.1, latency=0.2, generation_tps=10.0, slot=0, ticks=[1, 4],
                  draft_tokens=None, error=None),
    events.BatchDone(rank=1, requests=3, concurrency=4, generation_tokens=12, seconds=2.0, peak_memory=0.5,
                     decode_batch=2, ticks=40, run_ahead={"used": 1, "taken_back": 0},
                     time={"compute": 1.0, "busy": 0.5}),
    events.Serving(rank=0, concurrency=8, decode_batch=4),
    events.Finished(rank=0, id="req-1", finish_reason="error", prompt_tokens=3, cached_tokens=0,
                    generation_tokens=0, error="sampling failed"),
    events.Time(rank=0, memory=0.4, peak_memory=0.5, compute=1.0, send=0.1, recv=0.2, sync=0.3, idle=0.0,
                wall=1.6, busy=0.6),
    events.TrainDone(id=2, kind="step", rank=0, seconds=0.5, peak_memory=0.5, host="h", it=1, compute_seconds=0.4,
                     loss=2.5, ntoks=30, learning_rate=1e-5),
    events.Adapter(id=4, rank=0, data="AAAA"),
    download.FetchError(message="offline", hint="go online"),
    download.Check(present=["config.json"], missing=["model.safetensors"]),
    download.Fetching(bytes=1024),
    download.FileDone(name="config.json", status="present", bytes=12),
    download.FetchResult(host="h", path="/p", fetched_bytes=1, present_bytes=2, fetched_files=("a",),
                         present_files=("b",)),
    NodeExit(rank=1, line="Node with rank 1 exited with code 3", code=3),
]
REGISTRIES: list[Registry[Any]] = [messages.MESSAGES, events.EVENTS, events.TRAIN_EVENTS, download.FETCH_EVENTS,
                                   TRACKED]


def registry_of(sample: Wired) -> Registry[Any]:
    return next(r for r in REGISTRIES if r.classes.get(sample.TAG) is type(sample))


def name_of(sample: Wired) -> str:
    return type(sample).__name__


def test_every_message_and_event_has_a_sample() -> None:
    """A new message or event must be added above, so that it is tested too."""
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
