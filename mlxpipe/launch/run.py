"""Starting a pipeline: plan, preflight, download, check, launch, load.

The one launch sequence every command that runs a model goes through
(``generate``, ``chat``, ``generate --prompts-file``, ``serve``, ``lora``, the benchmarks),
as torchrun's ``run(config)``: the CLI fills a typed ``PipelineConfig`` (``launch.config``), which checks
every value as it is born (naming its flag) and builds the ranks' ``JobSpec`` itself;
this module runs it, and ``running_pipeline`` stops every rank on any way out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpipe import console
from mlxpipe.cluster.target import Target, load_model_metadata, plan_target
from mlxpipe.defaults import (
    DEFAULT_CONTEXT,
)
from mlxpipe.errors import PlanError, UsageError
from mlxpipe.launch.batch import RankStats
from mlxpipe.launch.config import PipelineConfig, draft_dir, draft_metadata, vision_job
from mlxpipe.launch.pipeline import Pipeline
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol.job import TrainSpec

if TYPE_CHECKING:
    from mlxpipe.download.controller import HostTask


def check_images(config: PipelineConfig, meta: ModelMetadata) -> None:
    """Refuse images the run cannot take (a text-only model, a pipeline that runs no vision tower) before launch."""
    from mlxpipe.vision.prompt import is_vision_config, require_vision

    require_vision()
    if not is_vision_config(meta.config):
        raise UsageError(f"--image: {meta.source} is a text-only model; it takes no images",
                         hint="pick a vision-language model, or drop --image")
    if not vision_job(meta.config, config.mode, False, config.draft_model is not None):
        raise UsageError("--image runs with the generic pipeline, without a draft model",
                         hint="drop --pipeline native and --draft-model")


def prepare(config: PipelineConfig, training: bool = False) -> tuple[ModelMetadata, Plan]:
    """Metadata and a plan that fits, every host checked and holding its files; nothing launched yet
    (``training``: the ranks load the text model alone, as LoRA does)."""
    from mlxpipe.cluster.doctor import preflight, require_ok

    target = config.target
    with console.ProgressCallback("reading safetensors headers", enabled=not config.quiet) as progress:
        meta = load_model_metadata(target, progress=progress)
    if config.images:
        check_images(config, meta)
    vision = vision_job(meta.config, config.mode, training, config.draft_model is not None)
    if vision:
        from mlxpipe.vision.families import check_family, check_tensor_parallel

        check_family(meta.config)
        check_tensor_parallel(meta.config, target.tp)
    the_plan = plan_target(target, meta, context=config.context or DEFAULT_CONTEXT)
    if vision:
        from mlxpipe.vision.families import check_deepstack

        check_deepstack(meta.config, the_plan.split)
    require_fit(the_plan)
    with _status("preflight: ssh, versions, ports, memory, disk...", config.quiet):
        require_ok(preflight(target.hostfile, the_plan, meta, port=config.ring_port(), backend=config.chosen_backend))
    ensure_files(the_plan, meta, target, config.from_controller, config.quiet)
    check_model_structure(meta, config.mode, config.trust_remote_code, config.target.tp, len(the_plan.split))
    if config.draft_model is not None:
        check_draft(ensure_draft(config), meta, config.trust_remote_code)
    return meta, the_plan


def ensure_draft(config: PipelineConfig) -> str:
    """The draft model on every host (a hub repo: fetched whole to each, as ``download`` does);
    return a directory on this machine holding its config and tokenizer."""
    from mlxpipe.download import controller as dl
    from mlxpipe.launch.pipeline import controller_model_dir

    assert config.draft_model is not None
    local = draft_dir(config.draft_model)
    if local is not None:
        return str(local)
    meta = draft_metadata(config)
    tasks = dl.whole_model_tasks(meta, config.target.hostfile.hosts)
    _fetch(tasks, meta, config.from_controller, config.quiet)
    return str(controller_model_dir(meta))


def check_draft(path: str, meta: ModelMetadata, trust: bool = False) -> None:
    """Refuse, before launch, a model whose caches cannot be trimmed and a draft model whose tokenizer
    is not the model's (mlx_lm.generate's checks)."""
    from mlx_lm.utils import load_tokenizer

    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.worker.load import build_without_weights, check_draft_vocab, check_trimmable

    model_dir = controller_model_dir(meta)
    check_trimmable(build_without_weights(model_dir, trust))
    model_vocab = load_tokenizer(model_dir).vocab_size
    check_draft_vocab(load_tokenizer(Path(path)).vocab_size, model_vocab, path)


def require_fit(the_plan: Plan) -> None:
    """Raise ``PlanError`` (exit 1) naming the first rank that cannot hold its share."""
    if the_plan.fits:
        return
    bad = next(r for r in the_plan.ranks if r.fits is False)
    suggested = the_plan.suggested_split
    hint = f"try --split {','.join(map(str, suggested))}" if suggested else "see `mlxpipe plan`"
    raise PlanError(f"rank {bad.rank} ({bad.host}) cannot hold layers {bad.start}-{bad.end - 1}", hint)


def launch(config: PipelineConfig, meta: ModelMetadata, the_plan: Plan,
           on_loaded: Callable[[RankStats], None] | None = None, train: TrainSpec | None = None) -> Pipeline:
    """Start one rank per host and wait until every rank has loaded its layers (and, with ``train``,
    added its LoRA adapters: ``mlxpipe lora``)."""
    pipe = Pipeline(meta, the_plan, config, train=train)
    if not config.quiet:
        console.err.print(f"[dim]starting {config.target.hostfile.size} ranks{_groups_text(the_plan)}: "
                          f"{pipe.run_dir}/command.txt[/]")
    try:
        with _status("loading layers on every rank...", config.quiet):
            pipe.start(on_loaded)
    except BaseException:
        pipe.stop()
        raise
    return pipe


def _groups_text(the_plan: Plan) -> str:
    """`` in 2 tensor-parallel groups of 2`` (nothing without --tp)."""
    if the_plan.tp == 1:
        return ""
    return f" in {len(the_plan.split)} tensor-parallel group{'s' if len(the_plan.split) > 1 else ''} of {the_plan.tp}"


def start_pipeline(config: PipelineConfig) -> Pipeline:
    """Plan, check every host, fetch what is missing, check the model, launch, and wait for every rank to load."""
    meta, the_plan = prepare(config)
    return launch(config, meta, the_plan)


@contextmanager
def running_pipeline(config: PipelineConfig) -> Iterator[Pipeline]:
    """A loaded pipeline; its ranks exit cleanly when the block ends, and are stopped on any error."""
    pipe = start_pipeline(config)
    try:
        yield pipe
    except BaseException:
        pipe.stop()
        raise
    pipe.close()


def ensure_files(the_plan: Plan, meta: ModelMetadata, target: Target, from_controller: bool, quiet: bool) -> None:
    """The download step: every host gets the files of its ranks (a no-op when they are there)."""
    from mlxpipe.download import controller as dl

    hosts = target.hostfile.hosts
    if meta.local and all(h.is_local and not h.model_dir for h in hosts):
        return  # every rank reads the directory itself
    _fetch(dl.host_tasks(the_plan, meta, hosts), meta, from_controller, quiet)


def _fetch(tasks: list[HostTask], meta: ModelMetadata, from_controller: bool, quiet: bool) -> None:
    """Each host fetches its task's files from the hub, or gets them from this machine."""
    from mlxpipe.download import controller as dl
    from mlxpipe.download.progress import download_progress

    with download_progress(tasks, enabled=not quiet) as on_update:
        if meta.local or from_controller:
            dl.distribute(tasks, meta, on_update)
        else:
            dl.run_on_hosts(tasks, on_update)


def check_model_structure(meta: ModelMetadata, mode: str, trust: bool, tp: int = 1, stages: int = 1) -> None:
    """Refuse, before any rank starts, a model the pipeline (with ``tp`` > 1: the tensor-parallel sharder) cannot
    handle: the ranks' own check (``worker.load.check_pipelinable``) on this machine's copy of the model."""
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.worker.load import check_pipelinable

    check_pipelinable(controller_model_dir(meta), mode=mode, trust_remote_code=trust, tp=tp, stages=stages)


def _status(text: str, quiet: bool) -> AbstractContextManager[object]:
    return nullcontext() if quiet else console.err.status(text, spinner="dots")

