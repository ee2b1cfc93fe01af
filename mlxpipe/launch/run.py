"""Starting a pipeline: plan, preflight, download, check, launch, load.

The one launch sequence every command that runs a model goes through
(``generate``, ``chat``, ``generate --prompts-file``, ``serve``, ``lora``, the benchmarks),
as torchrun's ``run(config)``: the CLI fills a typed ``PipelineConfig``, which checks
every value as it is born (naming its flag) and builds the ranks' ``JobSpec`` itself;
this module runs it, and ``running_pipeline`` stops every rank on any way out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpipe import console
from mlxpipe.cluster import storage
from mlxpipe.cluster.hostfile import check_backend, check_port
from mlxpipe.cluster.presets import pick
from mlxpipe.cluster.target import Target, load_model_metadata, plan_target
from mlxpipe.defaults import (
    DEFAULT_BACKEND,
    DEFAULT_CONTEXT,
    DEFAULT_STEP_TIMEOUT,
    MLX_LM_PREFILL_STEP,
    PIPELINE_PREFILL_STEP,
)
from mlxpipe.errors import PlanError, UsageError
from mlxpipe.launch.pipeline import WORKER, Pipeline, RankStats
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol.checks import at_least, check_mode, positive
from mlxpipe.protocol.job import JobSpec, TrainSpec
from mlxpipe.protocol.request import DEFAULT_NUM_DRAFT_TOKENS, check_fields

if TYPE_CHECKING:
    from mlxpipe.download.controller import HostTask


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides how a pipeline is started; the CLI's flags, each checked here, as it is born."""

    target: Target
    backend: str | None = None  # None: the preset's, else the hostfile's, else ring
    mode: str = "generic"
    prefill_step_size: int | None = None  # None: ``prefill_step`` picks for the pipeline
    port: int | None = None
    timeout: float = DEFAULT_STEP_TIMEOUT
    trust_remote_code: bool = False
    from_controller: bool = False
    quiet: bool = False  # no progress bars or status lines (--json, servers)
    context: int | None = None  # tokens the fit check reserves KV cache for (None: the planner's default)
    adapter_path: str | None = None  # LoRA adapters, at this path on every host
    draft_model: str | None = None  # speculative decoding: a directory at this path on every host, or a hub id
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    worker: tuple[str, ...] = WORKER  # tests run a worker that misbehaves on purpose
    images: bool = False  # the run is given images (--image): a model that takes none is refused before launch

    def __post_init__(self) -> None:
        check_mode(self.mode, "--pipeline")
        if self.prefill_step_size is not None:
            positive(self.prefill_step_size, "--prefill-step-size")
        positive(self.timeout, "--timeout")
        check_port(self.port, "--port")
        check_backend(self.backend, "--backend")
        if self.context is not None:
            at_least(self.context, 1, "--context")
        if self.target.tp > 1 and self.mode != "generic":
            # mlx-lm's own pipeline() splits the layers over the world group, with no room for groups.
            raise UsageError(f"--tp {self.target.tp} needs the generic pipeline", "drop --pipeline native")
        if self.adapter_path is not None:
            check_adapters(self.adapter_path)
            if self.mode != "generic":
                raise UsageError("--adapter-path needs the generic pipeline", "drop --pipeline native")
        check_fields({"num_draft_tokens": self.num_draft_tokens}, lambda _: "--num-draft-tokens")  # Request's range
        if self.draft_model is not None:
            check_draft_source(self.draft_model)

    @property
    def prefill_step(self) -> int:
        """The prefill chunk: the flag's, else chunks that pipeline (generic, 2+ ranks), else mlx-lm's."""
        if self.prefill_step_size is not None:
            return self.prefill_step_size
        if self.mode == "generic" and self.target.hostfile.size > 1:
            return PIPELINE_PREFILL_STEP
        return MLX_LM_PREFILL_STEP

    @property
    def chosen_backend(self) -> str:
        backend: str = pick(self.backend, self.target.preset.backend, self.target.hostfile.backend or DEFAULT_BACKEND)
        return backend

    @property
    def stages(self) -> int:
        """The pipeline's stages: one per tensor-parallel group of ``--tp`` hosts (one per host without)."""
        return self.target.stages

    def concurrency(self, decode_batch: int) -> int:
        """The requests in flight by default (``--concurrency``, serve's ``--max-concurrency``): ``decode_batch``
        per stage, so every stage has a decode micro-batch to run at every tick."""
        return self.stages * decode_batch

    def ring_port(self) -> int:
        """The ranks' first port: ``--port``, else mlx.launch's, or a free one when every rank is local."""
        from mlxpipe.launch.ranks import default_port

        return self.port or default_port(self.target.hostfile)

    def job_spec(self, meta: ModelMetadata, plan: Plan, train: TrainSpec | None = None) -> JobSpec:
        """The ranks' job: each rank's model directory on its own host, and the split (per stage with tp > 1:
        every member of a group runs its stage's layers, from its own host's copy of the stage's files)."""
        paths = draft_paths(self)
        return JobSpec(
            model_paths=[storage.model_path(h, meta) for h in self.target.hostfile.hosts],
            split=list(plan.split),
            mode=self.mode,
            trust_remote_code=self.trust_remote_code,
            prefill_step_size=self.prefill_step,
            train=train,
            adapter_path=self.adapter_path,
            draft_paths=list(paths) if paths is not None else None,
            num_draft_tokens=self.num_draft_tokens,
            tp=self.target.tp,
            vision=vision_job(meta.config, self.mode, train is not None, paths is not None),
        )


def vision_job(config: dict[str, Any], mode: str, training: bool, drafting: bool) -> bool:
    """Whether the ranks load a vision-language model with mlx-vlm (images in): its config has a vision tower's,
    mlx-vlm is installed here, and the run is one the engine serves (else the text model alone, as before)."""
    from mlxpipe.vision.prompt import is_vision_config, vision_installed

    return is_vision_config(config) and vision_installed() and mode == "generic" and not training and not drafting


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
    if vision_job(meta.config, config.mode, training, config.draft_model is not None):
        from mlxpipe.vision.families import check_family

        check_family(meta.config)
    the_plan = plan_target(target, meta, context=config.context or DEFAULT_CONTEXT)
    require_fit(the_plan)
    with _status("preflight: ssh, versions, ports, memory, disk...", config.quiet):
        require_ok(preflight(target.hostfile, the_plan, meta, port=config.ring_port(), backend=config.chosen_backend))
    ensure_files(the_plan, meta, target, config.from_controller, config.quiet)
    check_pipelinable(meta, config.mode, config.trust_remote_code, config.target.tp, len(the_plan.split))
    if config.draft_model is not None:
        check_draft(ensure_draft(config), meta, config.trust_remote_code)
    return meta, the_plan


def check_adapters(path: str) -> None:
    """Refuse an adapter directory without mlx-lm's two files, before anything starts.

    Remote hosts must hold it at the same path (a rank that does not says so, naming its host).
    """
    missing = [name for name in ("adapter_config.json", "adapters.safetensors") if not (Path(path) / name).is_file()]
    if missing:
        raise UsageError(f"--adapter-path {path}: no {' or '.join(missing)} there",
                         "give the directory mlx_lm.lora --adapter-path wrote")


def check_draft_source(draft: str) -> None:
    """Refuse a draft model that is neither a model directory nor a hub repo id, before anything starts.

    Every rank loads the whole draft model: a directory must be at this path on every host
    too; a hub repo is fetched to every host.
    """
    from mlxpipe.hub.client import is_repo_id

    path = draft_dir(draft)
    if path is not None:
        if not (path / "config.json").is_file():
            raise UsageError(f"--draft-model {draft}: no config.json there", "give the directory of an mlx-lm model")
    elif not is_repo_id(draft):
        raise UsageError(f"--draft-model {draft}: no such directory, and not a hub repo id",
                         "give a model directory (at the same path on every host) or a repo id such as "
                         "mlx-community/Qwen2.5-0.5B-Instruct-4bit (fetched to every host)")


def draft_dir(draft: str) -> Path | None:
    """The draft model's directory when ``--draft-model`` names one (else it is a hub repo id)."""
    path = Path(draft).expanduser()
    return path if path.is_dir() else None


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


def draft_metadata(config: PipelineConfig) -> ModelMetadata:
    from mlxpipe.hub.client import load_metadata

    assert config.draft_model is not None
    return load_metadata(config.draft_model)


def draft_paths(config: PipelineConfig) -> tuple[str, ...] | None:
    """The draft model's directory on each rank's host."""
    from mlxpipe.cluster import storage

    hosts = config.target.hostfile.hosts
    if config.draft_model is None:
        return None
    local = draft_dir(config.draft_model)
    if local is not None:
        return tuple(str(local) for _ in hosts)
    meta = draft_metadata(config)  # cached by ``ensure_draft``: no second request
    return tuple(storage.model_path(h, meta) for h in hosts)


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

    with console.download_progress(tasks, enabled=not quiet) as on_update:
        if meta.local or from_controller:
            dl.distribute(tasks, meta, on_update)
        else:
            dl.run_on_hosts(tasks, on_update)


def check_pipelinable(meta: ModelMetadata, mode: str, trust: bool, tp: int = 1, stages: int = 1) -> None:
    """Refuse a model the pipeline (with ``tp`` > 1: the tensor-parallel sharder) cannot handle before any
    rank starts."""
    from mlxpipe.launch.pipeline import controller_model_dir
    from mlxpipe.worker.load import check_pipelinable as check

    check(controller_model_dir(meta), mode=mode, trust_remote_code=trust, tp=tp, stages=stages)


def _status(text: str, quiet: bool) -> AbstractContextManager[object]:
    return nullcontext() if quiet else console.err.status(text, spinner="dots")

