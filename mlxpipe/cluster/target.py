"""What a command works on: the model, the hosts and the split, resolved once.

Flags win over the ``--config`` preset, which wins over the defaults (the demo
model on ``hostfiles/local-2.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpipe.cluster.hostfile import Hostfile, load_hostfile, parse_hostfile
from mlxpipe.cluster.presets import Preset, load_preset, pick
from mlxpipe.defaults import DEFAULT_BACKEND, DEFAULT_CONTEXT, DEFAULT_HOSTFILE
from mlxpipe.errors import ModelError, UsageError
from mlxpipe.host import LOCAL_HOST
from mlxpipe.model.metadata import ModelMetadata, validate
from mlxpipe.plan.choose import Choice, candidates
from mlxpipe.plan.cluster_facts import ClusterFacts
from mlxpipe.plan.parallel_layout import DEFAULT_WORKLOAD, LAYOUTS, Workload
from mlxpipe.plan.parallel_layout import workload as workload_named
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
    layout: str = "pipeline"  # auto: the cost model chooses tp and the split (``settle_layout``)
    layout_asked: bool = False  # --layout was given (not the default): say why a layout could not be weighed
    workload: Workload = DEFAULT_WORKLOAD  # what --layout auto and the balanced split weigh

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
    layout: str | None = None,
    workload: str | None = None,
) -> Target:
    """Apply flag > preset > default and read the hostfile.

    ``layout``: auto (the default where neither ``--tp`` nor ``--split`` is given, by flag or preset)
    or pipeline (the split of ``--strategy``, no cost model)."""
    preset = load_preset(config)
    chosen_model = pick(model, preset.model)
    if chosen_model is None:
        chosen_model = str(default_model())
    if split is None and strategy is None:
        split, strategy = preset.split, preset.strategy
    given = pick(tp, preset.tp) is not None or split is not None
    if layout is not None and layout not in LAYOUTS:
        raise UsageError(f"--layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if layout == "auto" and given:
        raise UsageError("--layout auto chooses --tp and the split itself", "give --layout auto, or --tp / --split")
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
        layout=layout or ("pipeline" if given else "auto"),
        layout_asked=layout is not None,
        workload=workload_named(workload),
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


def plan_target(target: Target, meta: ModelMetadata, *, context: int = DEFAULT_CONTEXT,
                backend: str | None = None) -> Plan:
    """The plan of ``target``'s model, split and tensor-parallel groups over its hosts (the balanced split weighs
    the hosts as the cluster's facts measured them, when there are any)."""
    from mlxpipe.cluster.facts_file import load_facts

    facts, _ = load_facts(target.hostfile)
    return make_plan(
        meta, target.hostfile.hosts, strategy=target.strategy, split=target.split, context=context, tp=target.tp,
        facts=facts, workload=target.workload, backend=_backend(target, backend),
    )


def _backend(target: Target, backend: str | None) -> str:
    chosen: str = pick(backend, target.preset.backend, target.hostfile.backend or DEFAULT_BACKEND)
    return chosen


@dataclass(frozen=True)
class Settled:
    """A target whose layout is fixed, and how: the layouts weighed (None when none were), or why not."""

    target: Target
    choice: Choice | None = None
    facts: ClusterFacts | None = None
    note: str | None = None  # why --layout auto kept the pipeline


Refusal = Callable[[int, int], "str | None"]  # (tp, stages) -> why the model cannot run so, or None


def settle_layout(target: Target, meta: ModelMetadata, *, context: int | None = None, backend: str | None = None,
                  tps: Sequence[int] | None = None, refuses: Refusal | None = None) -> Settled:
    """``--layout auto``: the layout the cost model predicts fastest for the target's workload, fixed into the
    target (its ``tp`` and strategy; the split follows from them). Without the cluster's measured facts the
    pipeline stays (its figures would be guesses: ``doctor --links`` measures them). ``tps``: only these group
    sizes; ``refuses``: what the ranks would refuse (the sharder's checks), on top of the plan's own."""
    if target.layout != "auto":
        return Settled(target)
    from mlxpipe.cluster.facts_file import facts_path, load_facts

    pipeline = replace(target, layout="pipeline")
    facts, why = load_facts(target.hostfile)
    if facts is None:
        measure = f"`mlxpipe doctor --links --hostfile {target.hostfile.path}`"
        return Settled(pipeline, note=f"layout: a pipeline ({why}; {measure} measures them, then --layout auto "
                                      "weighs --tp too)")
    choice = candidates(meta, target.hostfile.hosts, target.workload, facts=facts, backend=_backend(target, backend),
                        strategy=target.strategy, tps=tps, **({"context": context} if context else {}))
    if refuses is not None:
        choice = _without_refused(choice, refuses)
    if not choice.candidates:
        where = facts_path(target.hostfile.path).name
        return Settled(pipeline, choice, facts, note=f"layout: no layout fits ({where})")
    chosen = choice.chosen.layout
    return Settled(replace(target, tp=chosen.tp, tp_flag="--layout auto", strategy=chosen.strategy,
                           layout="pipeline"), choice, facts)


def _without_refused(choice: Choice, refuses: Refusal) -> Choice:
    kept, refused = [], list(choice.refused)
    for c in choice.candidates:
        why = refuses(c.layout.tp, c.layout.stages) if c.layout.tp > 1 else None
        if why is None:
            kept.append(c)
        else:
            refused.append((c.name, why))
    return replace(choice, candidates=tuple(kept), refused=tuple(refused))
