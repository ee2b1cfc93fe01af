"""What the commands that run a model (generate, chat, serve, plan, download, doctor) do with their typed configs
before the core runs: the draft model's flag combinations, and ``--layout auto`` settled by the cost model.

The configs themselves are built from the option groups (``_groups``), each checked as it is born.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxpipe.errors import UsageError

if TYPE_CHECKING:
    from mlxpipe.cluster.target import Settled, Target
    from mlxpipe.launch.config import PipelineConfig


def check_draft_flags(draft_model: str | None, max_kv_size: int | None) -> None:
    """Flag combinations speculative decoding does not take, refused before anything starts."""
    if draft_model is not None and max_kv_size is not None:
        # mlx-lm's speculative decoding silently drops max_kv_size; say so instead.
        raise UsageError("--max-kv-size does not work with --draft-model (speculative decoding trims whole caches)",
                         "drop one of them")


def settle_config(config: PipelineConfig, *, quiet: bool) -> PipelineConfig:
    """``--layout auto`` for a command that runs the model: ``config`` with the layout the cost model chooses
    (after its flags were checked), and a line on stderr saying which and why. --tp is weighed only for the
    generic pipeline without adapters or a draft model."""
    from dataclasses import replace

    if config.target.layout != "auto":
        return config
    tensor_ok = config.mode == "generic" and config.adapter_path is None and config.draft_model is None
    settled = settle_layout(config.target, quiet=quiet, backend=config.backend, context=config.context,
                            mode=config.mode, trust_remote_code=config.trust_remote_code, tensor_ok=tensor_ok)
    return replace(config, target=settled.target)


def settle_layout(target: Target, *, quiet: bool, backend: str | None, context: int | None, mode: str = "generic",
                  trust_remote_code: bool = False, tensor_ok: bool = True, meta: Any = None,
                  say: bool = True) -> Settled:
    """``--layout auto`` for a command that runs the model: the layout the cost model chooses, fixed into the
    target, and (``say``, not ``quiet``) a line on stderr saying which and why (``tensor_ok``: whether --tp may
    be weighed at all; ``meta``: the model's metadata, when read already)."""
    from mlxpipe import console
    from mlxpipe.cluster.target import Settled, load_model_metadata
    from mlxpipe.cluster.target import settle_layout as settle
    from mlxpipe.errors import MlxpipeError

    if target.layout != "auto":
        return Settled(target)
    if meta is None:
        with console.ProgressCallback("reading safetensors headers", enabled=not quiet) as progress:
            meta = load_model_metadata(target, progress=progress)

    def refuses(tp: int, stages: int) -> str | None:
        from mlxpipe.launch.run import check_model_structure

        try:
            check_model_structure(meta, mode, trust_remote_code, tp, stages)
        except MlxpipeError as e:
            return e.message
        return None

    tps = None if tensor_ok and mode == "generic" else (1,)
    settled = settle(target, meta, context=context, backend=backend, tps=tps, refuses=refuses)
    if say and not quiet:
        if settled.choice is not None and settled.choice.candidates:
            console.err.print(f"layout: {settled.choice.reason}", markup=False, highlight=False)
        elif settled.note and target.layout_asked:  # the default quietly stays the pipeline it always was
            console.err.print(settled.note, markup=False, highlight=False)
    return settled
