"""What a command works on: the model, the hosts and the split, resolved once.

Flags win over the ``--config`` preset, which wins over the defaults (the demo
model on ``hostfiles/local-2.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpipe.cluster.hostfile import Hostfile, load_hostfile, parse_hostfile
from mlxpipe.cluster.presets import Preset, load_preset, pick
from mlxpipe.defaults import DEFAULT_CONTEXT, DEFAULT_HOSTFILE
from mlxpipe.errors import ModelError
from mlxpipe.host import LOCAL_HOST
from mlxpipe.model.metadata import ModelMetadata, validate
from mlxpipe.plan.shard import Plan, make_plan
from mlxpipe.plan.tensor import check_tp

if TYPE_CHECKING:
    from mlxpipe.hub.client import Progress


@dataclass(frozen=True)
class Target:
    """A model on a cluster, as the user asked for it."""

    model: str
    revision: str | None
    hostfile: Hostfile
    strategy: str | None
    split: tuple[int, ...] | None
    preset: Preset
    tp: int = 1  # ranks per tensor-parallel group: each group of tp consecutive hosts is one pipeline stage
    tp_flag: str = "--tp"  # where tp came from, for its errors: the flag, or the preset's key

    def __post_init__(self) -> None:
        check_tp(self.tp, self.hostfile.size, self.tp_flag)

    @property
    def stages(self) -> int:
        """The pipeline's stages: a tensor-parallel group of ``tp`` hosts each (``check_tp``: they divide)."""
        return self.hostfile.size // self.tp


def resolve_target(
    model: str | None,
    revision: str | None,
    hostfile: Path | None,
    strategy: str | None,
    split: Sequence[int] | None,
    config: Path | None,
    tp: int | None = None,
) -> Target:
    """Apply flag > preset > default and read the hostfile."""
    preset = load_preset(config)
    chosen_model = pick(model, preset.model)
    if chosen_model is None:
        chosen_model = str(default_model())
    if split is None and strategy is None:
        split, strategy = preset.split, preset.strategy
    return Target(
        model=chosen_model,
        # A preset's revision belongs to the preset's model, not to one given by --model.
        revision=pick(revision, preset.revision if model is None else None),
        hostfile=load_hostfile(hostfile) if hostfile else default_hostfile(),
        strategy=strategy,
        split=tuple(split) if split else None,
        preset=preset,
        tp=pick(tp, preset.tp, 1),
        tp_flag="--tp" if tp is not None or preset.tp is None else f"{config}: key 'tp'",
    )


def default_model() -> Path:
    """The embedded demo model, which must have been built."""
    from mlxpipe.model.demo import demo_model_dir

    path = demo_model_dir()
    if not (path / "config.json").exists():
        raise ModelError(
            f"no --model given and the demo model is not built yet ({path})",
            "build it with `mlxpipe demo-model` (or `make demo`), or pass --model",
        )
    return path


def default_hostfile() -> Hostfile:
    """``hostfiles/local-2.json`` when run from the repo, else the same two local ranks."""
    if DEFAULT_HOSTFILE.exists():
        return load_hostfile(DEFAULT_HOSTFILE)
    local = {"ssh": LOCAL_HOST, "ips": [LOCAL_HOST]}
    return parse_hostfile([local, local], Path("<built-in local-2>"))


def load_model_metadata(target: Target, *, refresh: bool = False, progress: Progress | None = None) -> ModelMetadata:
    """The target model's metadata, validated for pipelining."""
    from mlxpipe.hub.client import load_metadata

    meta = load_metadata(target.model, target.revision, refresh=refresh, progress=progress)
    validate(meta)
    return meta


def plan_target(target: Target, meta: ModelMetadata, *, context: int = DEFAULT_CONTEXT) -> Plan:
    """The plan of ``target``'s model, split and tensor-parallel groups over its hosts."""
    return make_plan(
        meta, target.hostfile.hosts, strategy=target.strategy, split=target.split, context=context, tp=target.tp
    )
