"""The fleet file: which models one endpoint serves, each on which hosts of the hostfile, under which names.

A YAML file with one key, ``models``, a list of entries::

    models:
      - model: mlx-community/Qwen3-Coder-480B-A35B-Instruct-4bit
        hosts: [studio-1, studio-2, studio-3]   # the hostfile's hosts, by ssh name or by index
        names: [coder, claude-sonnet-4-5]       # more names requests may use; the model id always works
      - model: mlx-community/Qwen3-4B-Instruct-2507-4bit
        hosts: [3, 4]
        replicas: 2                              # the hosts split into 2 equal groups, each its own pipeline

Each entry may also give the options a single ``serve`` takes per model, under the flags' names: ``revision``,
``layout``, ``tp``, ``strategy``, ``context``, ``draft-model``, ``num-draft-tokens``, ``adapter-path``,
``prompt-cache-size``, ``prompt-cache-gb``; paths as the flags take them. Everything is checked here, where it is
born: a bad file is one line naming the file, the entry (index and model) and the key, and what to do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.errors import FleetError, MlxpipeError
from mlxpipe.paths import read_users_text
from mlxpipe.plan.parallel_layout import LAYOUTS
from mlxpipe.plan.splits import STRATEGIES

_TOP_KEYS = ("models",)
# The per-model options, by the flag's name (without its dashes), and the check each value gets.
_OPTIONS = ("revision", "layout", "tp", "strategy", "context", "draft-model", "num-draft-tokens", "adapter-path",
            "prompt-cache-size", "prompt-cache-gb")
_KEYS = ("model", "hosts", "names", "replicas", *_OPTIONS)
EXAMPLE = "models: [{model: <hub id or directory>, hosts: [<ssh name or index>, ...]}]"


@dataclass(frozen=True)
class FleetEntry:
    """One model of the fleet, on its hosts (indices into the cluster's hostfile), with its own options."""

    index: int  # its place in the file, for errors and logs
    model: str
    hosts: tuple[int, ...]
    names: tuple[str, ...] = ()
    replicas: int = 1
    revision: str | None = None
    layout: str | None = None
    tp: int | None = None
    strategy: str | None = None
    context: int | None = None
    draft_model: str | None = None
    num_draft_tokens: int | None = None
    adapter_path: str | None = None
    prompt_cache_size: int | None = None
    prompt_cache_gb: float | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may call it: the model id, then ``names``."""
        return (self.model, *(n for n in self.names if n != self.model))

    @property
    def label(self) -> str:
        """Its short name in the server's output: its first name, else the model id."""
        return self.names[0] if self.names else self.model

    def replica_label(self, replica: int) -> str:
        """One pipeline's name in the server's output: ``small``, or ``small#1`` among several replicas."""
        return self.label if self.replicas == 1 else f"{self.label}#{replica}"

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Each replica's hosts: ``hosts`` cut into ``replicas`` equal groups, in order."""
        size = len(self.hosts) // self.replicas
        return tuple(self.hosts[i * size:(i + 1) * size] for i in range(self.replicas))


@dataclass(frozen=True)
class Fleet:
    """A checked fleet file over the cluster's hostfile."""

    path: Path
    hostfile: Hostfile
    entries: tuple[FleetEntry, ...]

    def where(self, entry: FleetEntry) -> str:
        """``fleet.yaml: entry 1 (org/model)``: how errors name an entry."""
        return f"{self.path}: entry {entry.index} ({entry.model})"

    def replica_hostfile(self, entry: FleetEntry, replica: int) -> Hostfile:
        """The hostfile of one replica's pipeline: its hosts of the cluster's, ranked from 0 in the entry's order
        (it keeps the cluster's path, which errors and the links' facts are found by)."""
        chosen = entry.groups()[replica]
        hosts = tuple(replace(self.hostfile.hosts[i], rank=rank) for rank, i in enumerate(chosen))
        return replace(self.hostfile, hosts=hosts)

    def entry_for(self, name: str) -> FleetEntry | None:
        """The entry that answers to ``name``, if one does."""
        return next((e for e in self.entries if name in e.model_names), None)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the fleet answers to, entry by entry."""
        return tuple(n for e in self.entries for n in e.model_names)

    @contextmanager
    def errors_of(self, entry: FleetEntry) -> Iterator[None]:
        """An ``MlxpipeError`` raised within (a flag's check, a model that cannot be planned) as the fleet file's
        error: the file and the entry first."""
        try:
            yield
        except FleetError:
            raise
        except MlxpipeError as e:
            raise FleetError(f"{self.where(entry)}: {e.message}", e.hint) from None


def load_fleet(path: str | Path, hostfile: Hostfile) -> Fleet:
    """Read and check the fleet file at ``path`` against ``hostfile``."""
    path = Path(path)
    return parse_fleet(_read(path), path, hostfile)


def parse_fleet(data: Any, path: Path, hostfile: Hostfile) -> Fleet:
    """Check already-decoded fleet data; errors name ``path``."""
    if not isinstance(data, dict) or "models" not in data:
        raise FleetError(f"{path}: expected a mapping with a 'models' list", f"write it as {EXAMPLE}")
    unknown = sorted(set(map(str, data)) - set(_TOP_KEYS))
    if unknown:
        raise FleetError(f"{path}: unknown top-level key {unknown[0]!r}", "the top level holds only 'models'")
    raw = data["models"]
    if not isinstance(raw, list) or not raw:
        raise FleetError(f"{path}: 'models' must be a non-empty list of entries", f"write it as {EXAMPLE}")
    entries = tuple(_entry(path, i, item, hostfile) for i, item in enumerate(raw))
    _check_names(path, entries)
    return Fleet(path=path, hostfile=hostfile, entries=entries)


def _read(path: Path) -> Any:
    text = read_users_text(path, FleetError, "fleet file", "pass --fleet with an existing YAML file",
                           "a fleet file is YAML text")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise FleetError(f"{path}: not valid YAML ({str(e).strip().splitlines()[0]})",
                         f"write it as {EXAMPLE}") from None


def _entry(path: Path, index: int, raw: Any, hostfile: Hostfile) -> FleetEntry:
    where = f"{path}: entry {index}"
    if not isinstance(raw, dict):
        raise FleetError(f"{where}: expected a mapping with 'model' and 'hosts', got {type(raw).__name__}",
                         f"write it as {EXAMPLE}")
    model = raw.get("model")
    if not isinstance(model, str) or not model.strip():
        raise FleetError(f"{where}: {'no' if model is None else 'a bad'} 'model'",
                         "give the model as a hub repo id or a directory, as --model takes it")
    where = f"{where} ({model})"
    unknown = sorted(set(map(str, raw)) - set(_KEYS))
    if unknown:
        raise FleetError(f"{where}: unknown key {unknown[0]!r}", f"an entry's keys: {', '.join(_KEYS)}")
    if "hosts" not in raw:
        raise FleetError(f"{where}: no 'hosts'", "list the hostfile's hosts it runs on, by ssh name or by index")
    hosts = _hosts(where, raw["hosts"], hostfile)
    replicas = _number(where, raw, "replicas", int, 1) or 1
    if len(hosts) % replicas:
        raise FleetError(f"{where}: 'replicas' {replicas}: its {len(hosts)} hosts do not split into {replicas} "
                         "equal groups", f"list a multiple of {replicas} hosts, or give 'replicas' a divisor of "
                                         f"{len(hosts)}")
    entry = FleetEntry(
        index=index, model=model, hosts=hosts, names=_names(where, raw.get("names")), replicas=replicas,
        revision=_text(where, raw, "revision"), layout=_choice(where, raw, "layout", LAYOUTS),
        tp=_number(where, raw, "tp", int, 1), strategy=_choice(where, raw, "strategy", STRATEGIES[:3]),
        context=_number(where, raw, "context", int, 1), draft_model=_text(where, raw, "draft-model"),
        num_draft_tokens=_number(where, raw, "num-draft-tokens", int, 1),
        adapter_path=_text(where, raw, "adapter-path"),
        prompt_cache_size=_number(where, raw, "prompt-cache-size", int, 0),
        prompt_cache_gb=_number(where, raw, "prompt-cache-gb", float, 0),
    )
    _check_tp(where, entry)
    return entry


def _hosts(where: str, raw: Any, hostfile: Hostfile) -> tuple[int, ...]:
    """The entry's hosts as indices into ``hostfile``: each an index or a name the hostfile lists once."""
    if not isinstance(raw, list) or not raw:
        raise FleetError(f"{where}: 'hosts' must be a non-empty list", "list hostfile hosts by ssh name or by index")
    out: list[int] = []
    for item in raw:
        index = _host_index(where, item, hostfile)
        if index in out:
            raise FleetError(f"{where}: 'hosts' lists host {index} ({hostfile.hosts[index].ssh}) twice",
                             "list each host once; 'replicas' runs more pipelines on more hosts")
        out.append(index)
    return tuple(out)


def _host_index(where: str, item: Any, hostfile: Hostfile) -> int:
    known = ", ".join(f"{h.rank}: {h.ssh}" for h in hostfile.hosts)
    if isinstance(item, int) and not isinstance(item, bool):
        if 0 <= item < hostfile.size:
            return item
        raise FleetError(f"{where}: 'hosts': {hostfile.path} has no host {item}", f"its hosts: {known}")
    if not isinstance(item, str):
        raise FleetError(f"{where}: 'hosts': {item!r} is neither a host name nor an index", f"its hosts: {known}")
    matches = [h.rank for h in hostfile.hosts if h.ssh == item]
    if not matches:
        raise FleetError(f"{where}: 'hosts': {hostfile.path} has no host {item!r}", f"its hosts: {known}")
    if len(matches) > 1:
        raise FleetError(f"{where}: 'hosts': {item!r} is {len(matches)} hosts of {hostfile.path} "
                         f"({', '.join(map(str, matches))})", "name each of them by its index")
    return matches[0]


def _names(where: str, raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(n, str) and n.strip() for n in raw):
        raise FleetError(f"{where}: 'names' must be a list of non-empty names", "e.g. names: [coder, small]")
    return tuple(dict.fromkeys(raw))


def _check_names(path: Path, entries: tuple[FleetEntry, ...]) -> None:
    """Each name (model ids included) answers for one entry only."""
    owner: dict[str, FleetEntry] = {}
    for entry in entries:
        for name in entry.model_names:
            first = owner.setdefault(name, entry)
            if first is not entry:
                key = "model" if name == entry.model else "names"
                raise FleetError(f"{path}: entry {entry.index} ({entry.model}): '{key}': {name!r} is entry "
                                 f"{first.index}'s name too", "give each entry its own names (one model on more "
                                                               "hosts is one entry with 'replicas')")


def _text(where: str, raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise FleetError(f"{where}: '{key}' must be a non-empty string, got {value!r}",
                         f"give it as the flag --{key} takes it")
    return value


def _choice(where: str, raw: dict[str, Any], key: str, choices: tuple[str, ...]) -> str | None:
    value = _text(where, raw, key)
    if value is not None and value not in choices:
        raise FleetError(f"{where}: '{key}' {value!r}: use one of {', '.join(choices)}",
                         f"as the flag --{key} takes it (`mlxpipe serve --help`)")
    return value


def _number(where: str, raw: dict[str, Any], key: str, kind: Callable[[Any], Any], least: float) -> Any:
    """``raw[key]`` as an int (``kind`` int) or a finite number, at least ``least``; None when absent."""
    value = raw.get(key)
    if value is None:
        return None
    numbers = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numbers) or not math.isfinite(value) or value < least:
        what = "a whole number" if kind is int else "a number"
        raise FleetError(f"{where}: '{key}' must be {what} of at least {least:g}, got {value!r}",
                         f"as the flag --{key} takes it (`mlxpipe serve --help`)")
    return kind(value)


def _check_tp(where: str, entry: FleetEntry) -> None:
    """Each replica's hosts form whole tensor-parallel groups."""
    size = len(entry.hosts) // entry.replicas
    if entry.tp is not None and size % entry.tp:
        raise FleetError(f"{where}: 'tp' {entry.tp}: each replica's {size} hosts do not split into groups of "
                         f"{entry.tp}", f"give 'tp' a divisor of {size}, or list more hosts")
    if entry.layout == "auto" and entry.tp is not None:
        raise FleetError(f"{where}: 'layout' auto chooses 'tp' itself", "drop one of 'layout' and 'tp'")
