"""What every message and event on the wire is: a frozen dataclass that writes itself as JSON and reads itself
back strictly.

A ``Message`` goes from the controller to the ranks and names its kind under ``type``; an ``Event`` comes back
(from a rank, its supervisor, or the download script on a host) and names its kind under ``event``. A
``Registry`` maps those tags to their classes. ``from_wire`` refuses a field it does not know (a peer newer than
this side) and a field it lacks (a peer older, or a misspelled key), naming the message and the field, so that a
value never falls back to a default because its key was spelled wrong. A field that may be left out says so by
its default, in the dataclass: no reader supplies one of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from typing import Any, ClassVar, Generic, TypeVar

from mlxpipe.errors import WireError

Wire = dict[str, Any]  # one message or event as JSON
SAME_VERSION = "install the same mlxpipe version on every host"

W = TypeVar("W", bound="Wired")


class Wired:
    """A frozen dataclass that crosses the wire; see the module docstring. Subclasses set ``TAG``."""

    KEY: ClassVar[str]  # where the kind is written: "type" or "event"
    TAG: ClassVar[str]  # the kind, under KEY
    READER: ClassVar[str]  # who reads it, for errors: "worker" or "controller"
    NOUN: ClassVar[str]  # "message" or "event"

    def to_wire(self) -> Wire:
        """Every field, as JSON values, under the kind."""
        return {self.KEY: self.TAG, **self.wire_fields()}

    def wire_fields(self) -> Wire:
        """The fields as JSON values (nested messages override this and ``from_fields``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[W], data: Mapping[str, Any]) -> W:
        """``to_wire``'s output back; refuses another kind, and fields it does not know or lacks."""
        check_tag(cls, data)
        values = strict_fields(cls, data, f"the {cls.TAG!r} {cls.NOUN}", cls.READER, skip=(cls.KEY,))
        return cls.from_fields(values)

    @classmethod
    def from_fields(cls: type[W], values: dict[str, Any]) -> W:
        """The instance of ``values``, checked by ``strict_fields`` (nested messages override this)."""
        return cls(**values)


class Message(Wired):
    """What the controller sends every rank (through ``mlx.launch``'s standard input)."""

    KEY = "type"
    READER = "worker"
    NOUN = "message"


class Event(Wired):
    """What comes back to the controller: from a rank, its supervisor, or the download script on a host."""

    KEY = "event"
    READER = "controller"
    NOUN = "event"


class Registry(Generic[W]):
    """The classes of one stream of messages or events, by their tags: the tag picks the class."""

    def __init__(self, *classes: type[W]) -> None:
        self.key = classes[0].KEY
        self.classes: dict[str, type[W]] = {}
        for cls in classes:
            if self.key != cls.KEY or cls.TAG in self.classes:
                raise TypeError(f"{cls.__name__}: a second {cls.TAG!r}, or a kind under another key")
            self.classes[cls.TAG] = cls

    def __contains__(self, tag: object) -> bool:
        return tag in self.classes

    def extended(self, *classes: type[W]) -> Registry[W]:
        """This registry and ``classes``."""
        return Registry(*self.classes.values(), *classes)

    def from_wire(self, data: Mapping[str, Any]) -> W:
        """The message or event ``data`` is, by its tag; ``WireError`` for a tag this side does not know."""
        tag = tag_of(data, self.key)
        if tag not in self.classes:
            cls = next(iter(self.classes.values()))
            raise WireError(f"this {cls.READER} does not know the {cls.NOUN} {tag!r}", SAME_VERSION)
        return self.classes[tag].from_wire(data)


def check_tag(cls: type[Wired], data: Mapping[str, Any]) -> None:
    """Refuse ``data`` of another kind than ``cls`` (its tag may be left out: the registry read it already)."""
    if cls.KEY in data and data[cls.KEY] != cls.TAG:
        raise WireError(f"a {data[cls.KEY]!r} {cls.NOUN} read as a {cls.TAG!r} one")


def tag_of(data: Mapping[str, Any], key: str = "event") -> str:
    """The tag that says what ``data`` is (``data[key]``); ``WireError`` when it has none."""
    tag = data[key] if key in data else None  # noqa: SIM401 - no .get( on the wire: one grep finds them
    if not isinstance(tag, str):
        raise WireError(f"a line on the wire names no {key!r}: {str(dict(data))[:80]}")
    return tag


def strict_fields(cls: type, data: Mapping[str, Any], what: str, reader: str,
                  skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data``'s values for the dataclass ``cls`` (but ``skip``); ``WireError`` naming ``what`` and the fields
    ``cls`` does not know, else those it lacks that have no default."""
    known = {f.name: f for f in fields(cls)}
    values = {k: v for k, v in data.items() if k not in skip}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise WireError(f"{what} has fields this {reader} does not know: {', '.join(unknown)}", SAME_VERSION)
    missing = [name for name, f in known.items() if name not in values and _required(f)]
    if missing:
        raise WireError(f"{what} lacks the field{'s' if len(missing) > 1 else ''} {', '.join(missing)}",
                        SAME_VERSION)
    return values


def _required(f: Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING
