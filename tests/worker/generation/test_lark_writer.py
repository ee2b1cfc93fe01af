"""worker/generation/lark_writer.py: a grammar's rules as llguidance compiles and runs them (the markers as a
tokenizer holds them: tests/worker/generation/test_tool_grammar.py)."""

from __future__ import annotations

from mlxpipe.worker.generation.lark_writer import Lark, Markers


def test_optional_items_are_joined_by_their_separator_only_between_those_present() -> None:
    from llguidance import LLMatcher

    g = Lark(Markers("<c>", "</c>", None, {}, frozenset()))
    g.lines.insert(0, "start: " + g.joined([('"a"', True), ('"b"', False), ('"c"', True)], ", "))
    compiled = LLMatcher.grammar_from_lark(g.text())
    assert not LLMatcher.validate_grammar(compiled)
    for text, ok in [("b", True), ("a, b", True), ("b, c", True), ("a, b, c", True), (", b", False), ("a", False),
                     ("a b", False), ("b, ", False)]:
        assert _matches(compiled, text) is ok, text


def _matches(compiled: str, text: str) -> bool:
    import llguidance
    from llguidance import LLMatcher

    tokenizer = llguidance.LLTokenizer("byte")
    matcher = LLMatcher(tokenizer, compiled, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
