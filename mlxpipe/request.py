"""One generation request, typed: every option of ``mlx_lm.generate``, one set of defaults, one validation.

Command-line flags, prompts-file lines and HTTP bodies all become a ``Request``,
each naming a field its own way (``--max-tokens``, ``'max_tokens'``,
``'max_completion_tokens'``): ``Request.check`` says what is wrong with a field,
the caller says how its user spells it. The ranks read the same ``Request``
back from the JSON the controller sends (``to_wire`` / ``from_wire``), and
turn it into mlx-lm's own sampler, logits processors and KV-cache settings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Mapping

from mlxpipe.errors import UsageError

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

    def check(self, name: Name = lambda f: f"'{f}'") -> "Request":
        """This request, once every field is in range; raises ``RequestError`` naming the first that is not."""
        check_fields(asdict(self), name)
        return self

    def with_seed(self, seed: Callable[[], int]) -> "Request":
        """Sampled without a seed: give it one, so every rank samples alike and a run can be repeated."""
        return replace(self, seed=seed()) if self.temp > 0 and self.seed is None else self

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as JSON values (what the ranks read)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        if "logit_bias" in data:
            data["logit_bias"] = {str(k): v for k, v in data["logit_bias"].items()}
        if "extra_eos_token" in data:
            data["extra_eos_token"] = list(data["extra_eos_token"])
        return data

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "Request":
        """``to_wire``'s output back (a message's ``type`` is ignored); refuses fields it does not know."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k != "type"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(f"the request has fields this worker does not know: {', '.join(unknown)}",
                             hint="install the same mlxpipe version on every host")
        if values.get("logit_bias") is not None:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        if "extra_eos_token" in values:
            values["extra_eos_token"] = tuple(values["extra_eos_token"])
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


def _positive(v: Any) -> bool:
    return v >= 1


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
    "repetition_penalty": (lambda v: v >= 0, ">= 0"),
    "repetition_context_size": (lambda v: v >= 0, ">= 0"),
    "presence_context_size": (lambda v: v >= 0, ">= 0"),
    "frequency_context_size": (lambda v: v >= 0, ">= 0"),
    "max_kv_size": (_positive, "at least 1"),
    "kv_bits": (lambda v: v in KV_BITS, f"one of {', '.join(map(str, KV_BITS))}"),
    "kv_group_size": (lambda v: v in KV_GROUP_SIZES, f"one of {', '.join(map(str, KV_GROUP_SIZES))}"),
    "quantized_kv_start": (lambda v: v >= 0, ">= 0"),
    "num_draft_tokens": (_positive, "at least 1"),
}


def check_fields(values: Mapping[str, Any], name: Name) -> None:
    """Raise ``RequestError`` for the first of ``values``' fields out of range; ``name`` spells it."""
    for key, (ok, expected) in _RANGES.items():
        value = values.get(key)
        if value is not None and not ok(value):
            shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
            raise RequestError(key, f"{name(key)} must be {expected}, got {shown}")
    bias = values.get("logit_bias")
    if bias is not None and not all(isinstance(k, int) and k >= 0 for k in bias):
        raise RequestError("logit_bias", f"{name('logit_bias')} must map token ids (integers >= 0) to numbers")
    config = values.get("chat_template_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("chat_template_config", f"{name('chat_template_config')} must be a JSON object")


def parse_chat_template_config(text: str | None, name: str) -> dict[str, Any] | None:
    """``--chat-template-config '{"enable_thinking": false}'``: a JSON object, or a one-line error naming ``name``."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError("chat_template_config", f"{name} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(config, dict):
        raise RequestError("chat_template_config", f"{name} must be a JSON object, such as '{{\"enable_thinking\": false}}'")
    return config


def parse_logit_bias(value: Any, name: str) -> dict[int, float]:
    """A JSON ``logit_bias`` (as mlx_lm.server takes it: token id strings to numbers) as ``{id: bias}``."""
    if not isinstance(value, dict):
        raise RequestError("logit_bias", f"{name} must be an object of token ids to numbers")
    try:
        bias = {int(k): float(v) for k, v in value.items() if not isinstance(v, bool)}
    except (TypeError, ValueError):
        bias = {}
    if len(bias) != len(value) or any(k < 0 for k in bias):
        raise RequestError("logit_bias", f"{name} must be an object of token ids (integers >= 0) to numbers")
    return bias

