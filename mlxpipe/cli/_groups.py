"""The option groups the commands share, each defined once as a dataclass of ``_options``' aliases.

A command names a group as one parameter, ``target: TargetFlags``, and ``option_groups`` spreads the
group's fields into the signature Typer reads, in the group's order; the command then gets the group
built from them. So a command reads as parse -> typed config -> core -> render::

    @option_groups
    def plan(target: TargetFlags, ...) -> None:
        the_target = target.target()  # resolved and checked as it is born

A group holds the flags as given (None: not given); its methods build the typed, checked objects the
core takes (``Target``, ``Request``, ``PipelineConfig``). A command that takes only some of a group's
options, or words one its own way, says so where it names the group:
``Annotated[LaunchFlags, Take(drop=("pipeline_mode",), context=ServeContext)]``.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from mlxpipe.cli._options import (
    AdapterPath,
    Backend,
    ChatTemplateConfig,
    Config,
    Context,
    DraftModel,
    ExtraEosToken,
    FromController,
    Hostfile,
    IgnoreChatTemplate,
    KvBits,
    KvGroupSize,
    LayoutOption,
    MaxKvSize,
    MaxTokens,
    MinP,
    MinTokensToKeep,
    Model,
    NumDraftTokens,
    PipelineMode,
    PrefillResponse,
    PrefillStepSize,
    QuantizedKvStart,
    Revision,
    RingPort,
    Seed,
    Split,
    Strategy,
    SystemPrompt,
    Temp,
    Timeout,
    TopK,
    TopP,
    Tp,
    TrustRemoteCode,
    UseDefaultChatTemplate,
    WorkloadOption,
    XtcProbability,
    XtcThreshold,
    parse_split,
)
from mlxpipe.defaults import DEFAULT_STEP_TIMEOUT
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, Request

if TYPE_CHECKING:
    from mlxpipe.cluster.hostfile import Hostfile as HostList
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.cluster.target import Target
    from mlxpipe.launch.config import PipelineConfig

R = TypeVar("R")

# The flags a --config preset may give too (the flag wins, then the preset, then mlx_lm.generate's default).
_FROM_PRESET = ("max_tokens", "temp", "top_p", "min_p", "seed", "system_prompt")


class Take:
    """Which of a group's options a command takes (``only`` them, or all but ``drop``), and the ones it words its
    own way (``field=Alias``: another help text, or another flag, for the same field)."""

    def __init__(self, *, only: tuple[str, ...] | None = None, drop: tuple[str, ...] = (), **own: Any) -> None:
        self.only, self.drop, self.own = only, drop, own

    def names(self, group: type) -> list[str]:
        """The fields of ``group`` the command takes, in the group's order."""
        names = [f.name for f in fields(group)]
        unknown = [n for n in (*(self.only or ()), *self.drop, *self.own) if n not in names]
        if unknown:
            raise TypeError(f"{group.__name__} has no option {unknown[0]!r}")
        return [n for n in names if (self.only is None or n in self.only) and n not in self.drop]


def option_groups(command: Callable[..., R]) -> Callable[..., R]:
    """``command`` with each group parameter (a dataclass of option aliases, optionally ``Annotated`` with a
    ``Take``) spread into its options for Typer, and built back into the group when the command runs."""
    hints = typing.get_type_hints(command, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for name, param in inspect.signature(command).parameters.items():
        group, take = _group_of(hints[name])
        if group is None:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[name]))
            continue
        group_hints = typing.get_type_hints(group, include_extras=True)
        defaults = {f.name: f.default for f in fields(group)}
        taken = take.names(group)
        groups[name] = (group, taken)
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n],
                                     annotation=take.own.get(n, group_hints[n])) for n in taken]
    spelled = [p.name for p in params]
    if len(set(spelled)) != len(spelled):
        raise TypeError(f"{command.__name__}: an option is named twice: {sorted(spelled)}")

    @functools.wraps(command)
    def run(**given: Any) -> R:
        for name, (group, taken) in groups.items():
            given[name] = group(**{n: given.pop(n) for n in taken})
        return command(**given)

    # What Typer reads: the spread signature (inspect.signature stops at __signature__) and its annotations.
    run.__signature__ = inspect.Signature(params, return_annotation=hints.get("return"))  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def _group_of(hint: Any) -> tuple[type | None, Take]:
    """The group a parameter names (and what it takes of it), or None for a plain option."""
    take = Take()
    if typing.get_origin(hint) is typing.Annotated:
        hint, *extras = typing.get_args(hint)
        take = next((e for e in extras if isinstance(e, Take)), take)
    if isinstance(hint, type) and is_dataclass(hint):
        return hint, take
    return None, take


@dataclass(frozen=True)
class TargetFlags:
    """What a command works on, as given: the model, the hosts and how they split it."""

    model: Model = None
    hostfile: Hostfile = None
    revision: Revision = None
    strategy: Strategy = None
    split: Split = None
    tp: Tp = None
    layout: LayoutOption = None
    workload: WorkloadOption = None
    config: Config = None

    def target(self) -> Target:
        """The target: flag > preset > default, the hostfile read, ``--tp`` and ``--layout`` checked as it is born."""
        from mlxpipe.cluster.target import resolve_target

        return resolve_target(self.model, self.revision, self.hostfile, self.strategy, parse_split(self.split),
                              self.config, self.tp, self.layout, self.workload)

    def hosts(self) -> HostList:
        """The hosts alone, for a command that may run without a model (``doctor``): ``--tp`` checked against them
        by the target's own rule."""
        from mlxpipe.cluster.hostfile import load_hostfile
        from mlxpipe.cluster.target import default_hostfile
        from mlxpipe.plan.tensor import check_tp

        hosts = load_hostfile(self.hostfile) if self.hostfile else default_hostfile()
        check_tp(1 if self.tp is None else self.tp, hosts.size)
        return hosts

    @property
    def names_a_model(self) -> bool:
        """Whether any flag says which model to plan (else ``doctor`` checks the hosts alone)."""
        return any(v is not None for v in (self.model, self.revision, self.strategy, self.split, self.config))


@dataclass(frozen=True)
class RequestFlags:
    """The generation flags, as given (mlx_lm.generate's options, by its names): every request's defaults."""

    max_tokens: MaxTokens = None
    temp: Temp = None
    top_p: TopP = None
    min_p: MinP = None
    seed: Seed = None
    system_prompt: SystemPrompt = None
    ignore_chat_template: IgnoreChatTemplate = False
    top_k: TopK = Request.top_k
    min_tokens_to_keep: MinTokensToKeep = Request.min_tokens_to_keep
    xtc_probability: XtcProbability = Request.xtc_probability
    xtc_threshold: XtcThreshold = Request.xtc_threshold
    extra_eos_token: ExtraEosToken = None
    max_kv_size: MaxKvSize = None
    kv_bits: KvBits = None
    kv_group_size: KvGroupSize = Request.kv_group_size
    quantized_kv_start: QuantizedKvStart = Request.quantized_kv_start
    chat_template_config: ChatTemplateConfig = None
    use_default_chat_template: UseDefaultChatTemplate = False
    prefill_response: PrefillResponse = None

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


@dataclass(frozen=True)
class LaunchFlags:
    """How the pipeline starts, as given: the flags of every command that launches ranks."""

    context: Context = None
    adapter_path: AdapterPath = None
    draft_model: DraftModel = None
    num_draft_tokens: NumDraftTokens = DEFAULT_NUM_DRAFT_TOKENS
    backend: Backend = None
    pipeline_mode: PipelineMode = "generic"
    prefill_step_size: PrefillStepSize = None
    ring_port: RingPort = None
    timeout: Timeout = DEFAULT_STEP_TIMEOUT
    trust_remote_code: TrustRemoteCode = False
    from_controller: FromController = False

    def config(self, target: Target, *, quiet: bool, images: bool = False) -> PipelineConfig:
        """The typed config of the pipeline to start (``PipelineConfig`` checks every value as it is born, naming
        its flag); paths the ranks read are made absolute, since they run elsewhere."""
        from mlxpipe.launch.config import PipelineConfig

        adapters = self.adapter_path
        return PipelineConfig(
            target=target, backend=self.backend, mode=self.pipeline_mode, prefill_step_size=self.prefill_step_size,
            port=self.ring_port, timeout=self.timeout, trust_remote_code=self.trust_remote_code,
            from_controller=self.from_controller, quiet=quiet, context=self.context,
            adapter_path=str(adapters.expanduser().resolve()) if adapters is not None else None,
            draft_model=_model_dir_or_id(self.draft_model), num_draft_tokens=self.num_draft_tokens, images=images,
        )


def _model_dir_or_id(model: str | None) -> str | None:
    """A directory as an absolute path (the ranks run elsewhere), anything else as given (a hub id)."""
    from mlxpipe.launch.config import draft_dir

    local = draft_dir(model) if model is not None else None
    return model if local is None else str(local.resolve())

