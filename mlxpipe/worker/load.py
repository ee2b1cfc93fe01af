"""Load one rank's share of a model: its layers, the embeddings and the head.

Every rank's directory holds the config, the tokenizer and only the weight
files with its own layers (plus the files with the embeddings, final norm and
head). The model is built lazily, pipelined, and only then evaluated, so a
rank's peak memory is its share of the weights. Every rank, serving or training,
then says so in its ``loaded`` event (``loaded_event``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from mlxpipe.errors import ModelError, PlanError
from mlxpipe.model.facts import kv_sharing_groups, text_config_of
from mlxpipe.plan.splits import check_groups
from mlxpipe.protocol.events import Loaded
from mlxpipe.protocol.job import JobSpec
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.stages.cut import find_exchange, learn_layouts, pipeline_generic, pipeline_native, strip_weights
from mlxpipe.worker.stages.layers import check_supported, find_layers
from mlxpipe.worker.tensor import check_shardable, shard_model
from mlxpipe.worker.tensor.vocab import follow_exchange

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

_MAX_NAMED = 8  # missing tensors named in an error; the rest are counted


@dataclass
class LoadedModel:
    """One rank's pipelined model and what the ``loaded`` event reports."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]  # the model's config.json
    start: int
    end: int
    load_seconds: float
    draft: nn.Module | None = None  # the whole draft model of speculative decoding, on every rank
    topology: Topology | None = None  # this rank's stage and tensor group (None: built by hand, one stage)
    sharding: str = "none"  # how the stage's layers were sliced across its tensor group (``tensor.shard_model``)
    # A vision-language model (``worker.vision``): mlx-vlm's processor on the first stage (None elsewhere), and
    # whether its language model takes the position ids its embeddings compute (they cross the cuts).
    processor: Any = None
    vision: bool = False
    positions: bool = False


def loaded_event(job: JobSpec, group: mx.distributed.Group, loaded: LoadedModel, trainable: int | None = None,
                 frozen: int | None = None) -> Loaded:
    """What a rank's ``loaded`` event says (serving and training ranks alike)."""
    return Loaded(
        rank=group.rank(),
        host=socket.gethostname(),
        layers=[loaded.start, loaded.end],
        num_layers=sum(job.split),
        mode=job.mode,
        peak_memory=mx.get_peak_memory() / 1e9,
        load_seconds=loaded.load_seconds,
        trainable=trainable,
        frozen=frozen,
    )


class _LoadRecorder:
    """Remembers the tensor names ``load_model`` hands to ``load_weights``.

    ``load_model(strict=False)`` silently keeps random values for weights it
    did not find; these names are what really came from the files.
    """

    def __init__(self) -> None:
        self.loaded: dict[str, tuple[int, ...]] | None = None
        self.expected: dict[str, tuple[int, ...]] = {}

    def classes(self, config: dict[str, Any]) -> tuple[Callable[[Any], nn.Module], type]:
        """A ``get_model_classes`` for ``load_model`` that records the names."""
        model_class, args_class = _get_classes(config)

        def build(args: Any) -> nn.Module:  # args: the model's own ModelArgs class
            model: nn.Module = model_class(args)
            load_weights = model.load_weights

            def recording_load_weights(weights: list[tuple[str, mx.array]], strict: bool = True) -> nn.Module:
                self.loaded = {name: tuple(w.shape) for name, w in weights}
                self.expected = {name: tuple(p.shape) for name, p in flat_parameters(model.parameters())}
                return load_weights(weights, strict=strict)

            model.load_weights = recording_load_weights  # type: ignore[method-assign,assignment]  # load_model passes a list
            return model

        return build, args_class


def load_rank(job: JobSpec, group: mx.distributed.Group) -> LoadedModel:
    """Load, pipeline and evaluate this rank's part of the model."""
    tic = time.perf_counter()
    rank = group.rank()
    topology = Topology(group, job.tp)
    path = Path(job.model_paths[rank]).expanduser()  # remote paths may start with ~
    if not (path / "config.json").is_file():
        raise ModelError(f"rank {rank}: no config.json in {path}")
    if job.vision:
        return load_vision_rank(job, group, topology, path, tic)
    recorder = _LoadRecorder()
    model, config = load_model(
        path,
        lazy=True,
        strict=False,
        get_model_classes=recorder.classes,  # type: ignore[arg-type]  # a factory where mlx-lm takes a class
        trust_remote_code=job.trust_remote_code,
    )
    model.__dict__.pop("load_weights", None)
    if topology.stages > 1:
        try:
            check_groups(job.split, kv_sharing_groups(text_config_of(config)))
        except PlanError as e:
            raise ModelError(str(e), hint=e.hint) from e
    # Sliced before the cut, lazily: the slices of the layers other stages run are never evaluated.
    sharding = shard_model(model, topology)
    if job.mode == "native":
        start, end = pipeline_native(model, group, job.split)
    else:
        start, end = pipeline_generic(model, topology, job.split)
        if topology.sharded:
            follow_exchange(model, find_exchange(model))
    if recorder.loaded is not None:
        # A custom model file (trust_remote_code) bypasses the recorder.
        check_weights_loaded(model, recorder, path)
    if job.adapter_path is not None:
        load_local_adapters(model, Path(job.adapter_path).expanduser(), start, end, rank)
    mx.eval(model.parameters())
    if job.mode != "native":
        learn_layouts(model, topology)
    tokenizer = load_tokenizer(
        path,
        {"trust_remote_code": job.trust_remote_code},
        eos_token_ids=config.get("eos_token_id"),
    )
    draft = load_draft(job.draft_paths[rank], tokenizer, rank) if job.draft_paths is not None else None
    barrier(group)
    return LoadedModel(model, tokenizer, config, start, end, time.perf_counter() - tic, draft, topology, sharding)


def load_vision_rank(job: JobSpec, group: Any, topology: Topology, path: Path, tic: float) -> LoadedModel:
    """``load_rank`` for a vision-language model: mlx-vlm's model, its language model's blocks cut as any
    model's; the vision tower and projector kept (and the image processor loaded) on the first stage only."""
    from mlxpipe.vision.families import check_deepstack, family_type
    from mlxpipe.vision.prompt import load_vision_processor
    from mlxpipe.worker import vision

    model, config = vision.load_vision_model(path)
    model_type = family_type(config)
    unsupported = vision.unsupported_features(model, model_type)
    if unsupported:
        raise ModelError(f"{model_type}: its language model reads {', '.join(unsupported)} from the "
                         "vision tower, which the pipeline does not carry")
    check_deepstack(config, job.split)  # the controller's check, for a split it did not plan
    first = topology.stage == topology.stages - 1
    if not first:  # only the first stage runs the vision tower and projector
        for key in vision.vision_modules(model):
            strip_weights(model[key])
    sharding = shard_model(model, topology)
    start, end = pipeline_generic(model, topology, job.split)
    if topology.sharded:
        follow_exchange(model, find_exchange(model))
    mx.eval(model.parameters())
    learn_layouts(model, topology)
    tokenizer = load_tokenizer(path, {"trust_remote_code": job.trust_remote_code},
                               eos_token_ids=config.get("eos_token_id"))
    processor = load_vision_processor(path) if first else None
    positions = vision.needs_positions(model)
    barrier(group)
    return LoadedModel(model, tokenizer, config, start, end, time.perf_counter() - tic, None, topology, sharding,
                       processor=processor, vision=True, positions=positions)


def load_draft(path_text: str, tokenizer: TokenizerWrapper, rank: int) -> nn.Module:
    """The whole draft model, as mlx_lm.generate loads it, refused if its vocabulary is not the model's."""
    from mlx_lm.utils import load

    path = Path(path_text).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"rank {rank}: --draft-model {path}: no config.json there",
                         hint="copy the draft model's directory to the same path on every host, or give its hub id")
    draft, draft_tokenizer = load(str(path))[:2]  # without return_config: the model and its tokenizer
    check_draft_vocab(draft_tokenizer.vocab_size, tokenizer.vocab_size, path_text)
    mx.eval(draft.parameters())
    return draft


def check_draft_vocab(draft_vocab: int, model_vocab: int, path: str) -> None:
    """mlx_lm.generate's check: the draft's tokenizer must be the model's."""
    if draft_vocab != model_vocab:
        raise ModelError(f"--draft-model {path}: its tokenizer has {draft_vocab} tokens, the model's {model_vocab}",
                         hint="a draft model must share the model's tokenizer (a smaller model of the same family)")


def check_weights_loaded(model: nn.Module, recorder: _LoadRecorder, path: Path) -> None:
    """Raise ModelError naming local parameters the files lacked or got wrong."""
    loaded = recorder.loaded or {}
    missing, wrong = [], []
    for name, _ in flat_parameters(model.parameters()):
        if name not in loaded:
            missing.append(name)
        elif name in recorder.expected and loaded[name] != recorder.expected[name]:
            wrong.append(f"{name} {loaded[name]} (expected {recorder.expected[name]})")
    if missing:
        raise ModelError(
            f"{len(missing)} weights of this rank's layers are not in {path}: "
            + _some(sorted(missing)),
            hint="copy the weight files holding these layers to that directory",
        )
    if wrong:
        raise ModelError(
            f"{len(wrong)} weights in {path} have the wrong shape: " + _some(sorted(wrong)),
            hint="the weight files do not belong to this config.json",
        )


class _LocalLayers:
    """The model as ``linear_to_lora_layers`` sees it: only this rank's blocks in ``layers``."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        self.layers, self._model = layers, model

    def named_modules(self) -> Any:
        return self._model.named_modules()

    def update_modules(self, modules: Any) -> None:
        self._model.update_modules(modules)


def load_local_adapters(model: nn.Module, path: Path, start: int, end: int, rank: int) -> None:
    """mlx-lm's ``load_adapters`` for the layers ``[start, end)`` only.

    mlx-lm's ``linear_to_lora_layers`` converts the local blocks among the last
    ``num_layers`` (the stand-ins have no weights to wrap); of the adapter file,
    only the tensors of this rank's layers (and of modules outside the blocks)
    are loaded, so the other ranks' adapters need not be there at all.
    """
    import json
    import types

    from mlx_lm.tuner.utils import linear_to_lora_layers

    if not (path / "adapter_config.json").is_file():
        raise ModelError(f"rank {rank}: no adapter_config.json in {path}",
                         hint="copy the adapter directory to the same path on every host")
    config = types.SimpleNamespace(**json.loads((path / "adapter_config.json").read_text()))
    owner, key = find_layers(model)
    layers = owner[key]
    num_layers = getattr(config, "num_layers", len(layers))
    first = len(layers) - num_layers if 0 < num_layers < len(layers) else 0  # as model.layers[-num_layers:]
    fine_tune_type = getattr(config, "fine_tune_type", "lora")
    if fine_tune_type != "full":
        local = [layers[i] for i in range(max(first, start), end)]
        # The local blocks as the model: linear_to_lora_layers reads layers, named_modules and update_modules.
        linear_to_lora_layers(_LocalLayers(model, local), len(local), config.lora_parameters,  # type: ignore[arg-type]
                              use_dora=fine_tune_type == "dora")
    params = dict(flat_parameters(model.parameters()))
    prefix = _layers_prefix(model, layers)
    weights, wrong = [], []
    for name, w in cast(dict[str, mx.array], mx.load(str(path / "adapters.safetensors"))).items():
        index = _layer_index(name, prefix)
        if index is not None and not start <= index < end:
            continue  # another rank's layer
        adapter = name.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")
        if name not in params or (fine_tune_type != "full" and not adapter):
            wrong.append(f"{name}: not an adapter parameter of the model")
        elif w.shape != params[name].shape:
            wrong.append(f"{name}: shape {tuple(w.shape)}, the model's {tuple(params[name].shape)}")
        else:
            weights.append((name, w))
    if wrong:
        raise ModelError(f"the adapters in {path} do not fit this model: " + _some(wrong))
    model.load_weights(weights, strict=False)


def _layers_prefix(model: nn.Module, layers: list[nn.Module]) -> str:
    """The parameter-name prefix of the blocks (``model.layers.``)."""
    first = layers[0]
    for name, module in model.named_modules():
        if module is first:
            return str(name).rsplit(".", 1)[0] + "."
    raise ModelError("cannot find the model's blocks among its modules")


def _layer_index(name: str, prefix: str) -> int | None:
    """The block a parameter belongs to, or None outside the blocks."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _some(names: list[str]) -> str:
    """The first few of ``names``, then how many more."""
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return ", ".join(names[:_MAX_NAMED]) + more


def settle() -> None:
    """Wait for all work in flight on this rank, including mlx-lm's generation stream.

    ``generate_step`` evaluates one token ahead on ``generation_stream``; that
    step sends and receives on the group's sockets, so a collective on another
    stream must not start before it ends (their messages would interleave, and
    a rank leaving would cut the step's pending receive).
    """
    mx.synchronize(generation_stream)
    mx.synchronize()


def barrier(group: mx.distributed.Group) -> None:
    """Finish this rank's work in flight, then wait for every rank, on the CPU stream.

    On Metal a GPU-stream collective that waits more than a few seconds (a
    rank still loading) is killed by the GPU watchdog.
    """
    settle()
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def build_without_weights(model_path: str | Path, trust_remote_code: bool = False) -> nn.Module:
    """The model built from its config alone (no weights read): cheap, for checks before launch."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ModelError(f"no config.json in {path}")
    try:
        model, _ = load_model(
            path,
            lazy=True,
            strict=False,
            get_model_classes=_classes_without_weights,  # type: ignore[arg-type]  # as in load_rank
            trust_remote_code=trust_remote_code,
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"mlx-lm cannot build the model in {path}: {e}") from e
    return model


def check_trimmable(model: nn.Module) -> None:
    """Speculative decoding trims rejected drafts from the caches: refuse caches that cannot be (as mlx-lm)."""
    from mlx_lm.models.cache import make_prompt_cache

    untrimmable = sorted({type(c).__name__ for c in make_prompt_cache(model) if not c.is_trimmable()})
    if untrimmable:
        raise ModelError(f"--draft-model: speculative decoding trims rejected drafts from the KV caches, and this "
                         f"model's {', '.join(untrimmable)} cannot be trimmed", hint="drop --draft-model")


def check_pipelinable(
    model_path: str | Path, mode: str = "generic", trust_remote_code: bool = False, tp: int = 1, stages: int = 1
) -> None:
    """Raise ModelError unless mlxpipe can pipeline the model at ``model_path`` (and, with ``tp`` > 1,
    slice its layers across ``stages`` tensor-parallel groups of ``tp``).

    Cheap: builds the model from its config without reading any weights, so
    the controller can call it before launching ranks.
    """
    model = build_without_weights(model_path, trust_remote_code)
    if mode != "native":
        check_supported(model)
        if tp > 1:
            check_shardable(model, tp, stages)
    else:
        inner = model.get("model")
        if not callable(getattr(inner, "pipeline", None)):
            raise ModelError(
                f"{type(model).__module__} has no native mlx-lm pipeline",
                hint="use the generic pipeline mode",
            )


def _classes_without_weights(config: dict[str, Any]) -> tuple[Callable[[Any], nn.Module], type]:
    """``_get_classes`` whose models load no weights at all."""
    model_class, args_class = _get_classes(config)

    def build(args: Any) -> nn.Module:
        model: nn.Module = model_class(args)
        # Some sanitize methods index weights that an empty load lacks, and
        # whatever weight files are present need not be read to check structure.
        model.sanitize = lambda weights: {}
        return model

    return build, args_class


def flat_parameters(tree: Any) -> list[tuple[str, mx.array]]:
    """``tree_flatten`` of a module's parameters (a list: mlx types it as a list or the dict it may fill)."""
    return cast(list[tuple[str, mx.array]], tree_flatten(tree))
