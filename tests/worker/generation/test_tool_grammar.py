"""worker/generation/tool_grammar.py and tool_formats.py: the grammar of tool calls in each model's own format, in
one process.

Every format mlxpipe writes is checked the same way: replies drawn at random from what its grammar allows (a noise
model, with a seeded generator) are read back by mlx-lm's own parser of that format, through the server's own text
path (``serve.text``), and every call's arguments validate against its tool's schema. The tiny byte tokenizer
stands in for each model's (its tool-call tokens are added tokens, as Qwen's are); the grammar is compiled and run by
llguidance exactly as rank 0 runs it (``worker.generation.constraints.Constraint``).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from fixtures.tiny_models import VOCAB_SIZE
from fixtures.tool_model import write_tool_tokenizer
from mlxpipe.protocol.tools import Tool, ToolCalls
from mlxpipe.serve.text import Reply, tool_calls
from mlxpipe.worker.generation.constraints import Constraint, tool_compile_error, tool_grammar_of
from mlxpipe.worker.generation.lark_writer import Markers
from mlxpipe.worker.generation.tool_formats import FORMATS, SUPPORTED, Inexpressible, format_of, loosened
from mlxpipe.worker.generation.tool_grammar import grammar, starts_in_reasoning

# Bounded, so that a noise model's reply ends where the grammar does (strings, numbers, arrays).
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"type": "string", "enum": ["c", "f"]},
    "opts": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
             "required": ["tags"], "additionalProperties": False},
}, "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = (Tool("get_weather", WEATHER), Tool("get_time", TIME), Tool("ping", PING))
SCHEMAS = {t.name: t.parameters for t in TOOLS}
# What the doors hand mlx-lm's parsers (some read a parameter's declared type from it).
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]
# mlx-lm's parser module of each format (Mistral's two layouts share one parser).
PARSERS = {"json_tools": "json_tools", "qwen3_coder": "qwen3_coder", "glm47": "glm47", "longcat": "longcat",
           "minimax_m2": "minimax_m2", "kimi_k2": "kimi_k2", "mistral_json": "mistral", "mistral_args": "mistral",
           "pythonic": "pythonic"}
EOS = 258  # the tiny tokenizer's <|im_end|>
REPLIES = 8  # sampled replies per case
SHAPES = [(True, True), (True, False), (False, True), (False, False)]  # (required, parallel)


# Each format's markers that its models' tokenizers hold as added tokens (which llguidance reads as special):
# the grammar must write them as those tokens.
ADDED = {"glm47": ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
         "longcat": ["<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>",
                     "<longcat_arg_value>", "</longcat_arg_value>"],
         "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>"],
         "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                     "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
         "mistral": ["[TOOL_CALLS]", "[ARGS]"], "pythonic": ["<|tool_call_start|>", "<|tool_call_end|>"]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("tool-tokenizer")
    write_tool_tokenizer(dest)
    return dest


def wrapper(tokenizer_dir: Path, parser: str) -> Any:
    """mlx-lm's tokenizer over the tiny tool tokenizer (with ``parser``'s added tokens), with ``parser``'s markers
    and parser."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper, load
    from tokenizers import AddedToken

    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    hf = load(tokenizer_dir)._tokenizer
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED.get(parser, [])])
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=[EOS], tool_parser=module.parse_tool_call,
                            tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end)


def sample(constraint: Constraint, rng: np.random.Generator, prefix: list[int], free_after: bool) -> list[int]:
    """A reply drawn at random among the tokens the grammar allows, after ``prefix`` (fed through it); with
    ``free_after``, it may end at any point where the grammar allows the end (free text after a call)."""
    tokens = list(prefix)
    for token in prefix:
        constraint.allowed(VOCAB_SIZE)
        constraint.accept(token)
    while len(tokens) < 1000:
        allowed = np.flatnonzero(constraint.allowed(VOCAB_SIZE))
        if free_after and EOS in allowed and len(tokens) > len(prefix) and rng.random() < 0.3:
            return tokens
        token = int(rng.choice(allowed))
        if token == EOS:
            return tokens
        constraint.accept(token)
        tokens.append(token)
    raise AssertionError("the grammar did not end the reply")


def parsed(tokenizer: Any, tokens: list[int]) -> list[dict[str, Any]]:
    """The reply's tool calls as the server reads them (``serve.text``), each checked against its schema."""
    reply = Reply(tokenizer, [])
    texts = [t for token in tokens for t in reply.add(token).tool_calls] + reply.finish("stop").tool_calls
    for text in texts:  # the server skips a call its parser cannot read: here, that parser must read every one
        tokenizer.tool_parser(text, TEMPLATE_TOOLS)
    calls = tool_calls(tokenizer, texts, TEMPLATE_TOOLS, False)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(("required", "parallel"), SHAPES)
def test_every_reply_the_grammar_allows_parses_and_validates(tokenizer_dir: Path, fmt: str, required: bool,
                                                             parallel: bool) -> None:
    tokenizer = wrapper(tokenizer_dir, PARSERS[fmt])
    markers = replace(Markers.of(tokenizer), args_header=fmt == "mistral_args")
    calls = ToolCalls(PARSERS[fmt], TOOLS, required, parallel)
    lark = grammar(calls, markers)
    from llguidance import LLMatcher

    compiled = LLMatcher.grammar_from_lark(lark)
    assert not LLMatcher.validate_grammar(compiled)
    rng = np.random.default_rng(0)
    prefix = [] if required else tokenizer.encode(f"Let me look. {markers.start}", add_special_tokens=False)
    counts = []
    for _ in range(REPLIES):
        tokens = sample(Constraint(compiled, tokenizer, VOCAB_SIZE, {EOS}), rng, prefix, free_after=not required)
        counts.append(len(parsed(tokenizer, tokens)))
        for marker in ADDED.get(PARSERS[fmt], []):  # written as the model writes it: its own token
            if marker in tokenizer.decode(tokens[len(prefix):]):
                assert tokenizer.convert_tokens_to_ids(marker) in tokens, marker
    if not parallel:
        assert counts == [1] * REPLIES
    elif required:
        assert min(counts) >= 1 and max(counts) > 1, counts  # several calls, sometimes
    else:
        assert min(counts) >= 1, counts  # the call the reply opened, at least


@pytest.mark.parametrize("parallel", [True, False])
def test_under_auto_another_call_may_open_only_when_parallel(tokenizer_dir: Path, parallel: bool) -> None:
    tokenizer = wrapper(tokenizer_dir, "json_tools")
    calls = ToolCalls("json_tools", (Tool("get_time", TIME),), parallel=parallel)
    constraint = Constraint(tool_grammar_of(calls, tokenizer, []), tokenizer, VOCAB_SIZE, {EOS})
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    for token in tokenizer.encode(text, add_special_tokens=False):
        constraint.allowed(VOCAB_SIZE)
        constraint.accept(token)
    allowed = constraint.allowed(VOCAB_SIZE)
    assert allowed[EOS]
    if parallel:
        assert allowed[259] and allowed[ord("\n")]  # another call, or text
    else:
        assert np.flatnonzero(allowed).tolist() == [EOS]  # the one call, and the end


def test_a_named_tool_is_the_only_one_called(tokenizer_dir: Path) -> None:
    tokenizer = wrapper(tokenizer_dir, "json_tools")
    calls = ToolCalls("json_tools", (Tool("get_time", TIME),), required=True, parallel=False)
    rng = np.random.default_rng(1)
    for _ in range(REPLIES):
        constraint = Constraint(tool_grammar_of(calls, tokenizer, []), tokenizer, VOCAB_SIZE, {EOS})
        (call,) = parsed(tokenizer, sample(constraint, rng, [], free_after=False))
        assert call["function"]["name"] == "get_time"


def test_free_text_is_left_alone_until_a_call_opens(tokenizer_dir: Path) -> None:
    tokenizer = wrapper(tokenizer_dir, "json_tools")
    constraint = Constraint(tool_grammar_of(ToolCalls("json_tools", TOOLS), tokenizer, []), tokenizer, VOCAB_SIZE,
                            {EOS})
    free = constraint.allowed(VOCAB_SIZE)
    # Any text, the end, every special token (the chat markers) and the call's opening token are all allowed.
    assert free[EOS] and free[ord("a")] and free[256] and free[257] and free[259]
    constraint.accept(259)  # <tool_call>
    assert np.flatnonzero(constraint.allowed(VOCAB_SIZE)).tolist() == [ord("\n")]  # now the call's own text


def test_the_opening_marker_written_as_text_opens_a_call_too(tokenizer_dir: Path) -> None:
    tokenizer = wrapper(tokenizer_dir, "json_tools")
    constraint = Constraint(tool_grammar_of(ToolCalls("json_tools", TOOLS), tokenizer, []), tokenizer, VOCAB_SIZE,
                            {EOS})
    for byte in b"so <tool_call>":  # byte by byte, not the added token
        constraint.allowed(VOCAB_SIZE)
        constraint.accept(byte)
    assert np.flatnonzero(constraint.allowed(VOCAB_SIZE)).tolist() == [ord("\n")]


def test_markers_name_as_special_what_llguidance_reads_as_special(tokenizer_dir: Path) -> None:
    import llguidance.hf

    tokenizer = wrapper(tokenizer_dir, "json_tools")
    ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=VOCAB_SIZE, eos_token=[EOS])
    markers = Markers.of(tokenizer)
    assert all(ll.is_special_token(i) for i in markers.specials.values())  # Qwen's <tool_call> is, though not special
    assert not any(ll.is_special_token(i) for i in range(255))  # the bytes are text
    assert markers.lit("<tool_call>") == "<[259]>" and markers.lit("<call>") == '"<call>"'
    # A text holding added tokens is written as the tokenizer splits it.
    assert markers.lit("\n<tool_call>x</tool_call>") == '"\\n" <[259]> "x" <[260]>'


def test_a_forced_call_may_follow_the_models_reasoning(tokenizer_dir: Path, tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load
    from tokenizers import AddedToken, Tokenizer

    write_tool_tokenizer(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load(tmp_path)
    assert tokenizer.has_thinking and format_of(tokenizer) == "json_tools"
    calls = ToolCalls("json_tools", (Tool("get_time", TIME),), required=True)
    think, end_think = tokenizer.encode("<think></think>", add_special_tokens=False)
    assert starts_in_reasoning(tokenizer, [1, think]) and not starts_in_reasoning(tokenizer, [think, end_think])
    # The reply may open with its reasoning, or call at once.
    free = Constraint(tool_grammar_of(calls, tokenizer, []), tokenizer, VOCAB_SIZE, {EOS}).allowed(VOCAB_SIZE)
    assert np.flatnonzero(free).tolist() == [259, think]
    # A prompt that opened the reasoning: it must close before the call, and then the call comes.
    opened = Constraint(tool_grammar_of(calls, tokenizer, [1, think]), tokenizer, VOCAB_SIZE, {EOS})
    assert opened.allowed(VOCAB_SIZE)[ord("x")] and not opened.allowed(VOCAB_SIZE)[259]
    for token in tokenizer.encode("hmm</think>\n\n", add_special_tokens=False):
        opened.allowed(VOCAB_SIZE)
        opened.accept(token)
    assert opened.allowed(VOCAB_SIZE)[259]


@pytest.mark.parametrize(("fmt", "schema", "fragment"), [
    ("qwen3_coder", {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}},
     "'x'"),
    ("glm47", {"type": "object", "properties": {"x": {"type": "string", "enum": [" padded "]}}}, "'x'"),
    ("minimax_m2", {"type": "object", "properties": {"x": {"type": ["integer", "string"]}}}, "'x'"),
    ("qwen3_coder", {"type": "object", "properties": {}, "required": ["y"]}, "'y'"),
])
def test_a_schema_a_raw_value_format_cannot_hold_is_named(fmt: str, schema: dict[str, Any], fragment: str) -> None:
    markers = Markers("<tool_call>", "</tool_call>", None, {}, frozenset({EOS}))
    with pytest.raises(Inexpressible, match=fragment) as caught:
        grammar(ToolCalls(fmt, (Tool("f", schema),), required=True), markers)
    assert caught.value.tool == "f"


def test_a_loosened_tool_keeps_its_parameters_and_parses(tokenizer_dir: Path) -> None:
    loose_schema = {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
                    "required": ["x"]}
    calls = ToolCalls("qwen3_coder", (Tool("f", loose_schema),), required=True)
    tokenizer = wrapper(tokenizer_dir, "qwen3_coder")
    assert tool_compile_error(calls, tokenizer, []) == ("f", "the parameter 'x' of 'f' has a schema this model's "
                                                             "tool-call format cannot hold as a grammar")
    loose = loosened(calls, "f")
    assert loose.tools[0].parameters == {"type": "object", "properties": {"x": {}}, "required": ["x"]}
    assert tool_compile_error(loose, tokenizer, []) is None


def test_a_json_schema_llguidance_cannot_compile_is_found_tool_by_tool(tokenizer_dir: Path) -> None:
    tokenizer = wrapper(tokenizer_dir, "json_tools")
    bad = Tool("bad", {"type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}})
    error = tool_compile_error(ToolCalls("json_tools", (TOOLS[0], bad)), tokenizer, [])
    assert error is not None and error[0] == "bad" and "nowhere" in error[1]


def test_a_tool_call_format_mlxpipe_cannot_write_is_said(tokenizer_dir: Path) -> None:
    tokenizer = wrapper(tokenizer_dir, "gemma4")
    assert format_of(tokenizer) == "gemma4" and "gemma4" not in SUPPORTED
    error = tool_compile_error(ToolCalls("gemma4", TOOLS), tokenizer, [])
    assert error == (None, "no grammar writes the tool-call format 'gemma4'")
