"""Constrained decoding: a request's ``response_format`` as a grammar that masks its logits, token by token.

OpenAI's ``{"type": "json_object"}`` and ``{"type": "json_schema", ...}`` become an llguidance grammar
(``grammar_of``: a JSON schema compiled by llguidance's own JSON-schema compiler). The controller compiles it
once before admission (``compile_error``), so a schema llguidance cannot compile is a 400 and never reaches a
rank; rank 0, which samples, keeps one ``Constraint`` per request: llguidance's ``LLMatcher``, which computes
the mask of the tokens the grammar allows next and advances with each token sampled. Each request has its own,
so batched and overlapped requests keep their own grammar state. The grammar allows an end-of-sequence token
only once it is complete, and nothing else then, so a constrained reply ends exactly when its JSON does.

llguidance ships a Metal kernel for MLX masks, which does not run on the CPU backend; the mask here is
llguidance's bitmask unpacked with numpy and applied with ``mx.where``, which runs on every backend.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# JSON as json.dumps writes it (", " and ": ", no other whitespace): llguidance's default allows any whitespace
# between tokens, in which a small or unsure model can wander until max_tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_of(response_format: dict[str, Any]) -> Any:
    """The JSON schema a ``response_format`` asks for (json_object: any object)."""
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def grammar_of(response_format: dict[str, Any]) -> str:
    """The llguidance grammar of a (checked) ``response_format``; raises ``ValueError`` on a schema it cannot
    read."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema_of(response_format)), defaults=JSON_OPTIONS)


def compile_error(response_format: dict[str, Any]) -> str | None:
    """Why llguidance cannot compile ``response_format``'s schema (an unknown keyword, a bad ``$ref``, a regex
    that does not parse...), or None when it can."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(response_format)
    except (ValueError, TypeError) as e:
        return str(e)
    return LLMatcher.validate_grammar(grammar) or None


@lru_cache(maxsize=4)
def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:  # transformers' tokenizer
    """llguidance's view of the tokenizer (about a second to build for a 50k vocabulary: built once)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


def warm(tokenizer: TokenizerWrapper, vocab_size: int, eos_ids: set[int]) -> None:
    """Build llguidance's tokenizer ahead of the first constrained request (rank 0, when serving starts), so that
    request does not stall the pipeline for it."""
    _ll_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer), vocab_size, tuple(sorted(eos_ids)))


class Constraint:
    """One request's grammar state on the rank that samples: the mask before each token, the token after."""

    def __init__(
        self, response_format: dict[str, Any], tokenizer: TokenizerWrapper, vocab_size: int, eos_ids: set[int]
    ) -> None:
        from llguidance import LLMatcher

        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
        self.tokenizer = _ll_tokenizer(hf, vocab_size, tuple(sorted(eos_ids)))
        self.matcher = LLMatcher(self.tokenizer, grammar_of(response_format), log_level=0)
        self._check()
        self._words = np.full(((self.tokenizer.vocab_size + 31) // 32,), -1, dtype=np.int32)

    def allowed(self, width: int) -> np.ndarray:
        """The tokens the grammar allows next, as a boolean vector of ``width`` (the logits' last axis)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little").astype(bool)
        if bits.size < width:
            return np.concatenate([bits, np.zeros(width - bits.size, dtype=bool)])
        return bits[:width]

    def accept(self, token: int) -> None:
        """Advance past the sampled ``token`` (one the mask allowed)."""
        self.matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"the grammar of response_format failed: {self.matcher.get_error()}")
