"""serve/prefixes.py: a request's body keyed by its leading parts, and what a replica was sent."""

from __future__ import annotations

from mlxpipe.serve.prefixes import PIECE, Prefixes, chain

SYSTEM = {"role": "system", "content": "You are terse."}
TURN_1 = {"messages": [SYSTEM, {"role": "user", "content": "Name a city."}], "max_tokens": 8}
TURN_2 = {"messages": [*TURN_1["messages"], {"role": "assistant", "content": "Paris."},  # type: ignore[list-item]
                       {"role": "user", "content": "Another?"}], "max_tokens": 8, "temperature": 0.5}
OTHER = {"messages": [SYSTEM, {"role": "user", "content": "Name a river."}]}


def test_a_next_turn_matches_the_whole_last_turn_and_another_conversation_only_the_system_prompt() -> None:
    prefixes = Prefixes()
    prefixes.add(chain(TURN_1))
    first, second = chain(TURN_1), chain(TURN_2)
    assert second[: len(first)] == first  # the options (max_tokens, temperature) are no part of the prefix
    assert prefixes.match(second) == first[-1][1]
    assert 0 < prefixes.match(chain(OTHER)) == first[0][1] < first[-1][1]
    assert prefixes.match(chain({"messages": [{"role": "user", "content": "Name a city."}]})) == 0  # no system


def test_the_system_prompt_and_tools_lead_and_a_prompts_text_is_cut_into_pieces() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chain({"system": "Be terse.", "tools": tools, "messages": []}) != chain({"tools": tools, "messages": []})
    text = "x" * (2 * PIECE + 1)
    assert len(chain({"prompt": text})) == 3
    prefixes = Prefixes()
    prefixes.add(chain({"prompt": text}))
    assert prefixes.match(chain({"prompt": text + "y" * PIECE})) == chain({"prompt": text[: 2 * PIECE]})[-1][1]


def test_a_replica_remembers_only_the_latest_keys() -> None:
    prefixes = Prefixes(limit=3)
    prefixes.add(chain(TURN_1))  # 2 keys
    prefixes.add(chain(OTHER))  # the system prompt again (moved to the end), and 1 more: 3 keys held
    prefixes.add(chain({"messages": ["a", "b"]}))  # 2 more: the oldest two go
    assert prefixes.match(chain(TURN_1)) == 0
    assert prefixes.match(chain({"messages": ["a", "b"]})) > 0
