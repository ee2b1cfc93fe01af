"""The tool calls a reply may make, as rank 0's grammar holds them to (``worker.generation.tool_grammar``).

The controller reads a body's ``tool_choice``, ``parallel_tool_calls`` and strict tools (``serve.tool_choice``)
into one ``ToolCalls``; it travels inside the ``Request`` to the ranks, where rank 0 builds the grammar of the
model's own tool-call format from it, as the controller did to check it. ``tools`` are what the grammar enforces:
a tool whose schema the format cannot hold, and that is not strict, arrives already loosened to any object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxpipe.protocol.message import strict_fields


@dataclass(frozen=True)
class Tool:
    """One function the reply may call: its name and its arguments' JSON schema (an object's)."""

    name: str
    parameters: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Tool:
        return cls(**strict_fields(cls, data, "a tool of the request", "worker"))


@dataclass(frozen=True)
class ToolCalls:
    """What the reply's tool calls are held to.

    ``format`` is mlx-lm's tool parser of the model (``json_tools``, ``qwen3_coder``...): the grammar writes calls
    as that parser reads them. ``required``: the reply is tool calls from its first token (after the model's
    reasoning, if it thinks), at least one; else it is free text in which a call, once the model starts one, is
    completed under the grammar. ``parallel``: more than one call.
    """

    format: str
    tools: tuple[Tool, ...]
    required: bool = False
    parallel: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"format": self.format, "tools": [t.to_wire() for t in self.tools], "required": self.required,
                "parallel": self.parallel}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ToolCalls:
        values = strict_fields(cls, data, "the request's tool_calls", "worker")
        return cls(**{**values, "tools": tuple(Tool.from_wire(t) for t in values["tools"])})
