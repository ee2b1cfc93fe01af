"""The launch config: every flag that decides how a pipeline starts, each checked as it is born (naming its
flag), and the ranks' ``JobSpec`` it builds.

``launch.run`` runs it (plan, preflight, download, launch); ``launch.pipeline`` drives the ranks it started.
Neither is imported here, so both can name ``PipelineConfig`` without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxpipe.cluster import storage
from mlxpipe.cluster.hostfile import check_backend, check_port
from mlxpipe.cluster.presets import pick
from mlxpipe.cluster.target import Target
from mlxpipe.defaults import DEFAULT_BACKEND, DEFAULT_STEP_TIMEOUT, MLX_LM_PREFILL_STEP, PIPELINE_PREFILL_STEP
from mlxpipe.errors import UsageError
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol.checks import at_least, check_mode, positive
from mlxpipe.protocol.job import JobSpec, TrainSpec
from mlxpipe.protocol.request import DEFAULT_NUM_DRAFT_TOKENS, check_fields

WORKER = ("-m", "mlxpipe.worker")  # what each rank runs, after the host's python


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
        from mlxpipe.launch.command import default_port

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
