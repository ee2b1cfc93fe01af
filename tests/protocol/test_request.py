"""protocol/request.py: one typed request, the same validation everywhere (its exact tokens on
real ranks: ``e2e/test_options.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Request, RequestError
from mlxpipe.protocol.tools import Tool, ToolCalls

# ---------------------------------------------------------------- the typed request


def test_a_request_survives_the_wire() -> None:
    request = Request(prompt="x", id="a", temp=0.5, seed=3, logit_bias={7: -1.5}, extra_eos_token=("<eos>", "12"),
                      kv_bits=4, chat_template_config={"enable_thinking": False})
    wire = json.loads(json.dumps(request.to_wire()))  # as the ranks read it
    assert Request.from_wire({"type": "submit", **wire}) == request
    assert Request().to_wire() == {}  # defaults are not sent


def test_tool_calls_survive_the_wire_and_a_field_of_theirs_a_worker_does_not_know_is_refused() -> None:
    calls = ToolCalls("qwen3_coder", (Tool("f", {"type": "object"}), Tool("g", {"type": "object", "properties": {}})))
    request = Request(tokens=[1, 2], tool_calls=calls)
    wire = json.loads(json.dumps(request.to_wire()))
    assert wire["tool_calls"] == {"format": "qwen3_coder", "required": False, "parallel": True, "tools": [
        {"name": "f", "parameters": {"type": "object"}},
        {"name": "g", "parameters": {"type": "object", "properties": {}}}]}
    assert Request.from_wire(wire) == request and request.constrained
    with pytest.raises(UsageError, match="tool_calls has fields this worker does not know: grammar"):
        Request.from_wire({**wire, "tool_calls": {**wire["tool_calls"], "grammar": "x"}})
    with pytest.raises(UsageError, match="a tool of the request lacks the field parameters"):
        Request.from_wire({**wire, "tool_calls": {**wire["tool_calls"], "tools": [{"name": "f"}]}})


def test_a_worker_refuses_a_field_it_does_not_know() -> None:
    with pytest.raises(UsageError, match="fields this worker does not know: top_z"):
        Request.from_wire({"prompt": "x", "top_z": 3})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_k", -1, "'top_k' must be >= 0 (0: off), got -1"),
        ("xtc_probability", 1.5, "'xtc_probability' must be in [0, 1], got 1.5"),
        ("xtc_threshold", 0.6, "'xtc_threshold' must be in [0, 0.5], got 0.6"),
        ("min_tokens_to_keep", 0, "'min_tokens_to_keep' must be at least 1, got 0"),
        ("repetition_penalty", -1.0, "'repetition_penalty' must be >= 0, got -1"),
        ("max_kv_size", 0, "'max_kv_size' must be at least 1, got 0"),
        ("kv_bits", 7, "'kv_bits' must be one of 2, 3, 4, 5, 6, 8, got 7"),
        ("kv_group_size", 48, "'kv_group_size' must be one of 32, 64, 128, got 48"),
        ("quantized_kv_start", -1, "'quantized_kv_start' must be >= 0, got -1"),
    ],
)
def test_each_range_is_checked_once_for_every_caller(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as info:
        Request(**{field: value}).check()
    assert str(info.value) == message and info.value.field == field


@pytest.mark.parametrize(
    "field, value, message",
    [
        # Integers beyond what the ranks represent, floats that are not finite or absurd: every field has a range.
        ("presence_penalty", 2**70, "'presence_penalty' must be at most 100, got 1180591620717411303424"),
        ("repetition_penalty", 2**70, "'repetition_penalty' must be at most 100, got 1180591620717411303424"),
        ("frequency_penalty", -101, "'frequency_penalty' must be >= -100, got -101"),
        ("temp", 2**70, "'temp' must be at most 100, got 1180591620717411303424"),
        ("temp", float("nan"), "'temp' must be a finite number, got nan"),
        ("top_p", float("inf"), "'top_p' must be a finite number, got inf"),
        ("temp", "hot", "'temp' must be a finite number, got 'hot'"),
        ("temp", 10**400, "'temp' must be a finite number, got 100000... (401 digits)"),
        ("seed", -1, "'seed' must be >= 0, got -1"),
        ("seed", 2**64, "'seed' must be at most 18446744073709551615, got 18446744073709551616"),
        ("max_tokens", 2**31, "'max_tokens' must be at most 2147483647, got 2147483648"),
        ("max_tokens", True, "'max_tokens' must be an integer, got True"),
        ("top_k", 1.5, "'top_k' must be an integer, got 1.5"),
        ("repetition_context_size", 10**40, "'repetition_context_size' must be at most 2147483647, got 100000... "
                                            "(41 digits)"),
        ("extra_eos_token", tuple(str(i) for i in range(17)), "'extra_eos_token' takes at most 16 tokens"),
    ],
)
def test_every_number_is_checked_for_range_not_only_type(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as info:
        Request(**{field: value}).check()
    assert str(info.value).startswith(message) and info.value.field == field


@pytest.mark.parametrize(
    "bias, message",
    [
        ({128: 1.0}, "'logit_bias' must map token ids (integers 0 to 127) to numbers, got the key 128"),
        ({-1: 1.0}, "'logit_bias' must map token ids (integers 0 to 127) to numbers, got the key -1"),
        ({5: 101.0}, "'logit_bias'[5] must be a number between -100 and 100, got 101"),
        ({5: float("nan")}, "'logit_bias'[5] must be a number between -100 and 100, got nan"),
        ({5: "high"}, "'logit_bias'[5] must be a number between -100 and 100, got 'high'"),
        (dict.fromkeys(range(1025), 1.0), "'logit_bias' must map at most 1024 token ids to biases"),
    ],
)
def test_logit_bias_names_only_tokens_the_model_has(bias: dict[Any, Any], message: str) -> None:
    # A bias beyond the vocabulary crashes mlx's indexing (a segmentation fault, not an exception).
    with pytest.raises(RequestError) as info:
        Request(logit_bias=bias).check(vocab_size=128)
    assert str(info.value) == message


def test_checked_numbers_reach_mlx_lm_as_the_types_it_takes() -> None:
    import mlx.core as mx

    from mlxpipe.worker.generation.sampling import logits_processors

    # A JSON integer for a float option used to reach mlx-lm's processor as a Python int (std::bad_cast).
    request = Request(temp=1, presence_penalty=2, frequency_penalty=1, logit_bias={3: 2}, seed=5).check()
    assert [type(v) for v in (request.temp, request.presence_penalty, request.frequency_penalty)] == [float] * 3
    assert request.logit_bias == {3: 2.0} and type(request.seed) is int
    logits = mx.zeros((1, 8))
    for processor in logits_processors(request):
        logits = processor(mx.array([1, 2, 3]), logits)
    mx.eval(logits)
    assert logits[0, 3].item() == 2.0 - 2.0 - 1.0  # its bias, less the presence and the frequency (seen once) penalties


# ---------------------------------------------------------------- structured output's fields


@pytest.mark.parametrize(("values", "field"), [
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "prefill_response": "{"}, "response_format"),
])
def test_request_checks_the_new_fields(values: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as e:
        Request(prompt="p", **values).check()
    assert e.value.field == field


def test_text_format_is_free_text() -> None:
    assert Request(prompt="p", response_format={"type": "text"}).check().response_format is None


def test_a_resumed_request_continues_after_the_reply_so_far() -> None:
    request = Request(tokens=[1, 2, 3], max_tokens=10, temp=0.5, seed=4)
    resumed = request.resume([7, 8])
    assert (resumed.tokens, resumed.max_tokens, resumed.resumed, resumed.seed) == ([1, 2, 3, 7, 8], 8, 2, 4)
    assert Request.from_wire(resumed.to_wire()) == resumed  # as the ranks read it
    assert request.resume([]) is request
    with pytest.raises(RequestError, match="'resumed' must be >= 0"):
        Request(tokens=[1], resumed=-1).check()
