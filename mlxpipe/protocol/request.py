"""One generation request, typed: every option of ``mlx_lm.generate``, one set of defaults, one validation.

Command-line flags, prompts-file lines and HTTP bodies all become a ``Request``,
each naming a field its own way (``--max-tokens``, ``'max_tokens'``,
``'max_completion_tokens'``): ``Request.check`` says what is wrong with a field,
the caller says how its user spells it. The ranks read the same ``Request``
back from the JSON the controller sends (``to_wire`` / ``from_wire``, inside the messages of ``protocol.messages``), and
turn it into mlx-lm's own sampler, logits processors and KV-cache settings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, cast

from mlxpipe.errors import UsageError
from mlxpipe.protocol.message import strict_fields
from mlxpipe.protocol.tools import ToolCalls

# mlx_lm.generate's defaults (mlx_lm/generate.py), except max_tokens (mlxpipe's).
DEFAULT_MAX_TOKENS = 256
DEFAULT_XTC_THRESHOLD = 0.1
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
DEFAULT_NUM_DRAFT_TOKENS = 3  # speculative decoding's tokens per draft
DEFAULT_CONTEXT_SIZE = 20  # mlx-lm's repetition/presence/frequency context
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)

Name = Callable[[str], str]


@dataclass(frozen=True)
class Image:
    """One image of a request: its file's bytes (base64, as the doors receive them) and their SHA-256.

    The bytes go to every rank with the request (``mlx.launch`` broadcasts standard input), but only the
    first stage decodes them; the hash keys the prompt cache (``worker.generation.engine``), so a follow-up about the
    same picture reuses its prefix and another picture never does.
    """

    data: str
    sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"data": self.data, "sha256": self.sha256}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Image:
        return cls(**strict_fields(cls, data, "an image of the request", "worker"))


@dataclass(frozen=True)
class Request:
    """A generation request: its prompt, and mlx_lm.generate's options by the same names."""

    # The prompt: exactly one of prompt, messages and tokens (serve sends token ids).
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tokens: list[int] | None = None
    id: Any = None
    system_prompt: str | None = None
    ignore_chat_template: bool = False
    use_default_chat_template: bool = False
    chat_template_config: dict[str, Any] | None = None  # extra apply_chat_template kwargs
    prefill_response: str | None = None  # the start of the assistant's reply, continued
    # Sampling: mlx-lm's make_sampler.
    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = DEFAULT_XTC_THRESHOLD
    seed: int | None = None
    # Logits processors: mlx-lm's make_logits_processors (mlx_lm.server's body fields).
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = DEFAULT_CONTEXT_SIZE
    presence_penalty: float | None = None
    presence_context_size: int = DEFAULT_CONTEXT_SIZE
    frequency_penalty: float | None = None
    frequency_context_size: int = DEFAULT_CONTEXT_SIZE
    extra_eos_token: tuple[str, ...] = ()  # tokens (or ids) that also end the reply
    # The KV cache: mlx-lm's make_prompt_cache and maybe_quantize_kv_cache.
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    keep_cache: bool = False  # chat: keep this request's cache for the next turn
    # Speculative decoding's drafted tokens per pass for this request (mlx_lm.server's body field);
    # None: the run's --num-draft-tokens. Without a draft model it changes nothing, as in mlx-lm.
    num_draft_tokens: int | None = None
    # What rank 0 reports with each token: its log-probability and the ``top_logprobs`` most likely tokens'.
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrained decoding (``worker.generation.constraints``): OpenAI's ``{"type": "json_object"}`` or
    # ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``; None: free text.
    response_format: dict[str, Any] | None = None
    # Images in (a vision-language model): the prompt as the controller tokenized it holds each image's
    # placeholder tokens; ``vision_prompt`` is the text the image processor expanded into them, which the first
    # stage processes again with the pixels.
    images: tuple[Image, ...] = ()
    vision_prompt: str | None = None

    # Tool calls held to the model's own format by the same grammar engine (``worker.generation.tool_grammar``):
    # forced by ``tool_choice``, or completed once the model starts one; None: the reply's tool calls are the model's
    # alone.
    tool_calls: ToolCalls | None = None
    # A request continued after its ranks failed (``serve.queue``): the last ``resumed`` of ``tokens`` are the reply
    # already sent to its client. Rank 0's sampler starts from its random key as it was after them, and its grammar
    # reads them first, so the reply goes on as it would have (``worker.generation.sampling``).
    resumed: int = 0

    @property
    def constrained(self) -> bool:
        """Whether rank 0 masks this request's logits with a grammar (structured output or tool calls)."""
        return self.response_format is not None or self.tool_calls is not None

    def check(self, name: Name = lambda f: f"'{f}'", vocab_size: int | None = None) -> Request:
        """This request, once every field is in range (its numbers normalized: integers as ``int``, the rest as
        ``float``); raises ``RequestError`` naming the first that is not. ``vocab_size`` bounds ``logit_bias``."""
        normalized = check_fields(asdict(self), name, vocab_size)
        return replace(self, **normalized) if normalized else self

    def resume(self, sent: Sequence[int]) -> Request:
        """This request (as first sent) continued after ``sent``, the reply's tokens its client already has: they
        join the prompt, and count against ``max_tokens``."""
        if not sent:
            return self
        assert self.tokens is not None, "serve sends token ids"
        return replace(self, tokens=[*self.tokens, *sent], max_tokens=self.max_tokens - len(sent), resumed=len(sent))

    def with_seed(self, seed: Callable[[], int]) -> Request:
        """Sampled without a seed: give it one, so every rank samples alike and a run can be repeated."""
        return replace(self, seed=seed()) if self.temp > 0 and self.seed is None else self

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as JSON values (what the ranks read)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        if "logit_bias" in data:
            data["logit_bias"] = {str(k): v for k, v in data["logit_bias"].items()}
        if "extra_eos_token" in data:
            data["extra_eos_token"] = list(data["extra_eos_token"])
        if "tool_calls" in data:
            data["tool_calls"] = data["tool_calls"].to_wire()
        if "images" in data:
            data["images"] = [image.to_wire() for image in data["images"]]
        return data

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Request:
        """``to_wire``'s output back (the ``type`` of the message carrying it is left out); refuses fields it
        does not know."""
        values = strict_fields(cls, data, "the request", "worker", skip=("type",))
        if "logit_bias" in values and values["logit_bias"] is not None:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        if "extra_eos_token" in values:
            values["extra_eos_token"] = tuple(values["extra_eos_token"])
        if values.get("tool_calls") is not None:
            values["tool_calls"] = ToolCalls.from_wire(values["tool_calls"])
        if "images" in values:
            values["images"] = tuple(Image.from_wire(image) for image in values["images"])
        return cls(**values)

    # --- what mlx-lm takes -----------------------------------------------------------

    def sampler_kwargs(self) -> dict[str, Any]:
        """``make_sampler``'s arguments (the XTC special tokens come from the tokenizer)."""
        return {"temp": self.temp, "top_p": self.top_p, "min_p": self.min_p,
                "min_tokens_to_keep": self.min_tokens_to_keep, "top_k": self.top_k,
                "xtc_probability": self.xtc_probability, "xtc_threshold": self.xtc_threshold}

    def logits_kwargs(self) -> dict[str, Any]:
        """``make_logits_processors``' arguments."""
        return {"logit_bias": self.logit_bias,
                "repetition_penalty": self.repetition_penalty, "repetition_context_size": self.repetition_context_size,
                "presence_penalty": self.presence_penalty, "presence_context_size": self.presence_context_size,
                "frequency_penalty": self.frequency_penalty, "frequency_context_size": self.frequency_context_size}

    def kv_kwargs(self) -> dict[str, Any]:
        """``maybe_quantize_kv_cache``'s (and ``stream_generate``'s) KV-quantization arguments."""
        return {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size,
                "quantized_kv_start": self.quantized_kv_start}


class RequestError(UsageError):
    """A request field out of range; ``field`` is its canonical name (``max_tokens``, ``temp``...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# What the ranks can represent: counts and sizes fit 32 bits, a seed is mx.random's 64-bit key.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**64 - 1
# Beyond these a value means nothing more (a temperature of 100 is already uniform sampling) and only
# risks overflowing float32 logits.
MAX_TEMP = 100.0
MAX_PENALTY = 100.0
MAX_BIAS = 100.0  # OpenAI's logit_bias range
MAX_BIAS_ENTRIES = 1024
MAX_EXTRA_EOS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs range
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _positive(v: Any) -> bool:
    return bool(v >= 1)


# field -> (is it in range, what the range is); None values are not checked.
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_positive, "at least 1"),
    "temp": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "min_tokens_to_keep": (_positive, "at least 1"),
    "top_k": (lambda v: v >= 0, ">= 0 (0: off)"),
    "xtc_probability": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "xtc_threshold": (lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
    "seed": (lambda v: v >= 0, ">= 0"),
    "repetition_penalty": (lambda v: v >= 0, ">= 0"),
    "repetition_context_size": (lambda v: v >= 0, ">= 0"),
    "presence_penalty": (lambda v: v >= -MAX_PENALTY, f">= -{MAX_PENALTY:g}"),
    "presence_context_size": (lambda v: v >= 0, ">= 0"),
    "frequency_penalty": (lambda v: v >= -MAX_PENALTY, f">= -{MAX_PENALTY:g}"),
    "frequency_context_size": (lambda v: v >= 0, ">= 0"),
    "max_kv_size": (_positive, "at least 1"),
    "kv_bits": (lambda v: v in KV_BITS, f"one of {', '.join(map(str, KV_BITS))}"),
    "kv_group_size": (lambda v: v in KV_GROUP_SIZES, f"one of {', '.join(map(str, KV_GROUP_SIZES))}"),
    "quantized_kv_start": (lambda v: v >= 0, ">= 0"),
    "num_draft_tokens": (_positive, "at least 1"),
    "top_logprobs": (lambda v: v >= 0, ">= 0"),
    "resumed": (lambda v: v >= 0, ">= 0"),
}
# The most each number may be: what the ranks can represent (integers), or what still means something.
_HIGHEST: dict[str, float] = {
    **{key: MAX_COUNT for key in _RANGES if key not in ("temp", "top_p", "min_p", "xtc_probability", "xtc_threshold")},
    "seed": MAX_SEED,
    "top_logprobs": MAX_TOP_LOGPROBS,
    "temp": MAX_TEMP,
    "repetition_penalty": MAX_PENALTY,
    "presence_penalty": MAX_PENALTY,
    "frequency_penalty": MAX_PENALTY,
}
_INTEGER = {"max_tokens", "min_tokens_to_keep", "top_k", "seed", "repetition_context_size", "presence_context_size",
            "frequency_context_size", "max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start",
            "num_draft_tokens", "top_logprobs", "resumed"}


def check_fields(values: Mapping[str, Any], name: Name, vocab_size: int | None = None) -> dict[str, Any]:
    """Raise ``RequestError`` for the first of ``values``' fields of the wrong type or out of range; ``name``
    spells it. Returns the numeric fields normalized (integers as ``int``, the others as ``float``)."""
    normalized: dict[str, Any] = {}
    for key, (ok, expected) in _RANGES.items():
        value = values.get(key)
        if value is None:
            continue
        number = _number(value, integer=key in _INTEGER)
        if number is None:
            kind = "an integer" if key in _INTEGER else "a finite number"
            raise RequestError(key, f"{name(key)} must be {kind}, got {_shown(value)}")
        if not ok(number):
            raise RequestError(key, f"{name(key)} must be {expected}, got {_shown(value)}")
        highest = _HIGHEST.get(key)
        if highest is not None and number > highest:
            limit = str(int(highest)) if key in _INTEGER else f"{highest:g}"
            raise RequestError(key, f"{name(key)} must be at most {limit}, got {_shown(value)}")
        normalized[key] = number
    bias = values.get("logit_bias")
    if bias is not None:
        normalized["logit_bias"] = _check_bias(bias, name, vocab_size)
    eos = values.get("extra_eos_token")
    if eos is not None and (len(eos) > MAX_EXTRA_EOS or not all(isinstance(t, str) and t for t in eos)):
        raise RequestError("extra_eos_token", f"{name('extra_eos_token')} takes at most {MAX_EXTRA_EOS} tokens "
                                              "(non-empty strings)")
    config = values.get("chat_template_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("chat_template_config", f"{name('chat_template_config')} must be a JSON object")
    if not isinstance(values.get("logprobs", False), bool):
        raise RequestError("logprobs", f"{name('logprobs')} must be true or false")
    if "response_format" in values:
        normalized["response_format"] = check_response_format(values["response_format"], name)
        if normalized["response_format"] is not None and values.get("prefill_response") is not None:
            raise RequestError("response_format", f"{name('response_format')} cannot be combined with a prefilled "
                                                  "reply (the grammar starts at the reply's first token)")
    return normalized


def check_response_format(value: Any, name: Name) -> dict[str, Any] | None:
    """``response_format``'s shape (the schema itself is compiled by ``worker.generation.constraints``):
    ``{"type": "text"}`` is None (free text); ``json_schema`` needs ``json_schema.schema``, an object."""
    if value is None:
        return None
    field = name("response_format")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RequestError("response_format", f"{field} must be an object whose 'type' is one of "
                                              f"{', '.join(RESPONSE_FORMATS)}, got {_shown(value)}")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise RequestError("response_format", f"{field} of type json_schema needs 'json_schema': "
                                                  "{'name': ..., 'schema': {...}} with the schema an object")
        name_ = spec.get("name")
        if name_ is not None and not isinstance(name_, str):
            raise RequestError("response_format", f"{field}.json_schema.name must be a string")
    return cast(dict[str, Any], value)  # an object: its type was read above


def _number(value: Any, integer: bool) -> int | float | None:
    """``value`` as the field's kind of number, None when it is not one (bools, strings, NaN, infinities)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if integer:
        return value if isinstance(value, int) else None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return number if math.isfinite(number) else None


def _check_bias(bias: Any, name: Name, vocab_size: int | None) -> dict[int, float]:
    """``logit_bias``: token ids the model has (a bias beyond the vocabulary crashes mlx), finite biases."""
    field = name("logit_bias")
    if not isinstance(bias, dict) or len(bias) > MAX_BIAS_ENTRIES:
        raise RequestError("logit_bias", f"{field} must map at most {MAX_BIAS_ENTRIES} token ids to biases")
    top = (vocab_size - 1) if vocab_size else MAX_COUNT
    checked = {}
    for token, value in bias.items():
        number = _number(value, integer=False)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= top:
            raise RequestError("logit_bias", f"{field} must map token ids (integers 0 to {top}) to numbers, "
                                             f"got the key {_shown(token)}")
        if number is None or not -MAX_BIAS <= number <= MAX_BIAS:
            raise RequestError("logit_bias", f"{field}[{token}] must be a number between -{MAX_BIAS:g} and "
                                             f"{MAX_BIAS:g}, got {_shown(value)}")
        checked[token] = number
    return checked


def _shown(value: Any) -> str:
    """A value in an error message: whole when short, cut when absurd."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        return text if len(text) <= 24 else f"{text[:6]}... ({len(text)} digits)"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)[:60]


def parse_chat_template_config(text: str | None, name: str) -> dict[str, Any] | None:
    """``--chat-template-config '{"enable_thinking": false}'``: a JSON object, or a one-line error naming ``name``."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError("chat_template_config", f"{name} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(config, dict):
        raise RequestError(
            "chat_template_config", f"{name} must be a JSON object, such as '{{\"enable_thinking\": false}}'"
        )
    return config


def parse_logit_bias(value: Any, name: str) -> dict[Any, Any]:
    """A JSON ``logit_bias`` (as mlx_lm.server takes it: token id strings to numbers) with integer keys;
    ``Request.check`` checks the ids and the biases."""
    if not isinstance(value, dict):
        raise RequestError("logit_bias", f"{name} must be an object of token ids to numbers")
    keys = {}
    for key, bias in value.items():
        try:
            keys[int(key)] = bias
        except (TypeError, ValueError):
            raise RequestError("logit_bias", f"{name} must be an object of token ids (integers >= 0) to numbers, "
                                             f"got the key {str(key)[:40]!r}") from None
    return keys
