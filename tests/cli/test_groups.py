"""cli/_groups.py: an option group is written once and spread into each command that takes it, in its order, with
what the command takes of it; the command gets the group back, built from the flags."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from mlxpipe.cli._groups import Take, option_groups

First = Annotated[str | None, typer.Option("--first", help="The first.")]
Second = Annotated[int, typer.Option("--second", help="The second.")]
Third = Annotated[bool, typer.Option("--third", help="The third.")]
OtherSecond = Annotated[int, typer.Option("--other-second", help="The second, worded otherwise.")]
Last = Annotated[str, typer.Option("--last", help="A command's own.")]


@dataclass(frozen=True)
class Group:
    first: First = None
    second: Second = 2
    third: Third = False


def run(command: Any, *args: str) -> Any:
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)  # two commands: the first is called by its name
    return CliRunner().invoke(app, [command.__name__, *args])


def test_a_group_is_spread_in_its_order_and_built_back() -> None:
    seen: list[Any] = []

    @option_groups
    def command(*, group: Group, last: Last = "z") -> None:
        seen.append((group, last))

    assert list(inspect.signature(command).parameters) == ["first", "second", "third", "last"]
    assert run(command, "--second", "5", "--third", "--last", "y").exit_code == 0
    assert seen == [(Group(None, 5, True), "y")]
    assert run(command).exit_code == 0
    assert seen[-1] == (Group(), "z")


def test_a_command_takes_part_of_a_group_and_words_an_option_its_own_way() -> None:
    seen: list[Group] = []

    @option_groups
    def command(*, group: Annotated[Group, Take(drop=("third",), second=OtherSecond)]) -> None:
        seen.append(group)

    assert list(inspect.signature(command).parameters) == ["first", "second"]
    assert run(command, "--other-second", "7").exit_code == 0
    assert seen == [Group(None, 7, False)]  # what it does not take keeps the group's default
    assert run(command, "--third").exit_code == 2

    @option_groups
    def only(*, group: Annotated[Group, Take(only=("third",))]) -> None:
        seen.append(group)

    assert list(inspect.signature(only).parameters) == ["third"]


def test_a_name_the_group_does_not_have_or_an_option_named_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="Group has no option 'fourth'"):
        @option_groups
        def unknown(*, group: Annotated[Group, Take(drop=("fourth",))]) -> None: ...

    with pytest.raises(TypeError, match="an option is named twice"):
        @option_groups
        def twice(*, group: Group, first: First = None) -> None: ...
