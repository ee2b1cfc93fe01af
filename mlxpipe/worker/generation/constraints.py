"""Constrained decoding: a grammar that masks a request's logits, token by token.

Two things become an llguidance grammar. Structured output: OpenAI's ``{"type": "json_object"}`` and
``{"type": "json_schema", ...}`` (``grammar_of``: a JSON schema compiled by llguidance's own JSON-schema
compiler). Tool calls: a request's ``tool_calls`` (``tool_grammar_of``: the model's own tool-call format, written by
``worker.generation.tool_grammar``). The controller compiles each once before admission (``compile_error``,
``tool_compile_error``), so a grammar llguidance cannot compile is a 400 and never reaches a rank; rank 0, which
samples, keeps one ``Constraint`` per request: llguidance's ``LLMatcher``, which computes the mask of the tokens the
grammar allows next and advances with each token sampled. Each request has its own, so batched and overlapped
requests keep their own grammar state. The grammar allows an end-of-sequence token only once it is complete, and
nothing else then, so a constrained reply ends exactly when its JSON (or its last tool call) does.

llguidance ships a Metal kernel for MLX masks, which does not run on the CPU backend; the mask here is
llguidance's bitmask unpacked with numpy and applied with ``mx.where``, which runs on every backend.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxpipe.protocol.request import Request
from mlxpipe.protocol.tools import ToolCalls
from mlxpipe.worker.generation.lark_writer import Markers
from mlxpipe.worker.generation.tool_formats import Inexpressible, format_of
from mlxpipe.worker.generation.tool_grammar import grammar, starts_in_reasoning

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


def tool_grammar_of(calls: ToolCalls, tokenizer: TokenizerWrapper, prompt: list[int]) -> str:
    """The llguidance grammar of a request's ``tool_calls`` for mlx-lm's ``tokenizer`` (``prompt``: its token
    ids, which say whether the reply starts inside the model's reasoning); raises ``ValueError`` (``Inexpressible``
    naming a tool) when the model's format cannot hold it."""
    from llguidance import LLMatcher

    if format_of(tokenizer) != calls.format:
        raise ValueError(f"this model writes tool calls as {format_of(tokenizer)!r}, not {calls.format!r}")
    lark = grammar(calls, Markers.of(tokenizer), starts_in_reasoning(tokenizer, prompt))
    return LLMatcher.grammar_from_lark(lark)


def tool_compile_error(
    calls: ToolCalls, tokenizer: TokenizerWrapper, prompt: list[int]
) -> tuple[str | None, str] | None:
    """Why ``calls`` cannot be a grammar for this model: (the tool at fault, or None for the whole, the reason);
    None when it can. A JSON schema llguidance cannot compile is found tool by tool."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(tool_grammar_of(calls, tokenizer, prompt))
    except Inexpressible as e:
        return e.tool, str(e)
    except ValueError as e:
        return None, str(e)
    if not error:
        return None
    for tool in calls.tools:
        alone = ToolCalls(calls.format, (tool,), calls.required, calls.parallel)
        own = LLMatcher.validate_grammar(tool_grammar_of(alone, tokenizer, prompt))
        if own:
            return tool.name, own
    return None, error


def request_grammar(request: Request, tokenizer: TokenizerWrapper) -> str:
    """The grammar of a constrained request (``Request.constrained``): its ``response_format``'s, else its tool
    calls'."""
    if request.response_format is not None:
        return grammar_of(request.response_format)
    assert request.tool_calls is not None
    tokens = list(request.tokens or ())
    prompt = tokens[: len(tokens) - request.resumed]  # a resumed request's reply so far is read by the grammar
    return tool_grammar_of(request.tool_calls, tokenizer, prompt)


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

    def __init__(self, grammar: str, tokenizer: TokenizerWrapper, vocab_size: int, eos_ids: set[int]) -> None:
        from llguidance import LLMatcher

        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
        self.tokenizer = _ll_tokenizer(hf, vocab_size, tuple(sorted(eos_ids)))
        self.matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
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
            raise ValueError(f"the grammar failed: {self.matcher.get_error()}")
