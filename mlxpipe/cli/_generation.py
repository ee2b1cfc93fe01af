"""What the commands that run a model (generate, chat, serve, lora) make of their flags, written once.

``RequestFlags``: the generation flags, which become every request's defaults; ``pipeline_config``:
the typed config of the pipeline to start. Both check on construction, naming the flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, Request

if TYPE_CHECKING:
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.cluster.target import Settled, Target
    from mlxpipe.launch.config import PipelineConfig

# The flags a --config preset may give too (the flag wins, then the preset, then mlx_lm.generate's default).
_FROM_PRESET = ("max_tokens", "temp", "top_p", "min_p", "seed", "system_prompt")


@dataclass(frozen=True)
class RequestFlags:
    """The generation flags one command takes, as given (None: not given, or not a flag of that command)."""

    max_tokens: int | None = None
    temp: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    system_prompt: str | None = None
    ignore_chat_template: bool = False
    top_k: int | None = None
    min_tokens_to_keep: int | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    extra_eos_token: list[str] | None = None
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    chat_template_config: str | None = None
    use_default_chat_template: bool | None = None
    prefill_response: str | None = None

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> RequestFlags:
        """The generation flags among a command's parameters (Typer gives each flag as its own parameter:
        the command hands them over at once, ``RequestFlags.of(locals())``)."""
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})

    def request(self, preset: Preset) -> Request:
        """The generation options every request gets: the flags, then ``preset``'s, then mlx_lm.generate's
        defaults; a value out of range is refused naming its flag."""
        from mlxpipe.cluster.presets import pick
        from mlxpipe.protocol.request import parse_chat_template_config

        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _FROM_PRESET}
        given = {k: v for k, v in given.items() if v is not None}
        if "chat_template_config" in given:
            given["chat_template_config"] = parse_chat_template_config(given["chat_template_config"],
                                                                       "--chat-template-config")
        if "extra_eos_token" in given:
            given["extra_eos_token"] = tuple(given["extra_eos_token"])
        request = Request(
            max_tokens=pick(self.max_tokens, preset.max_tokens, DEFAULT_MAX_TOKENS),
            temp=pick(self.temp, preset.temp, Request.temp),
            top_p=pick(self.top_p, preset.top_p, Request.top_p),
            min_p=pick(self.min_p, preset.min_p, Request.min_p),
            seed=pick(self.seed, preset.seed),
            system_prompt=pick(self.system_prompt, preset.system_prompt),
            **given,
        )
        return request.check(lambda field: "--" + field.replace("_", "-"))


def pipeline_config(target: Target, *, backend: str | None, mode: str = "generic",
                    prefill_step_size: int | None = None, port: int | None, timeout: float, trust_remote_code: bool,
                    quiet: bool, from_controller: bool = False, context: int | None = None,
                    adapter_path: Path | None = None, draft_model: str | None = None,
                    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS, images: bool = False) -> PipelineConfig:
    """The typed config of the pipeline the flags describe (``PipelineConfig`` checks them on construction)."""
    from mlxpipe.launch.config import PipelineConfig

    return PipelineConfig(
        target=target, backend=backend, mode=mode, prefill_step_size=prefill_step_size, port=port, timeout=timeout,
        trust_remote_code=trust_remote_code, from_controller=from_controller, quiet=quiet, context=context,
        adapter_path=str(adapter_path.expanduser().resolve()) if adapter_path is not None else None,
        draft_model=_model_dir_or_id(draft_model),
        num_draft_tokens=num_draft_tokens,
        images=images,
    )


def _model_dir_or_id(model: str | None) -> str | None:
    """A directory as an absolute path (the ranks run elsewhere), anything else as given (a hub id)."""
    from mlxpipe.launch.config import draft_dir

    local = draft_dir(model) if model is not None else None
    return model if local is None else str(local.resolve())


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
