"""The options the commands share, each defined once as a ``typing.Annotated`` alias.

A command names an option by its alias and gives its default: ``max_tokens: MaxTokens = None``.
Options whose default is None mean something all the same: ``show_default`` says what, in the same
place and style as a real default. (Rich markup would swallow a hand-written "[default: ...]".)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxpipe.defaults import (
    DEFAULT_BACKEND,
    DEFAULT_CONTEXT,
    DEFAULT_HOSTFILE,
    DEFAULT_PORT,
    MLX_LM_PREFILL_STEP,
    PIPELINE_PREFILL_STEP,
)
from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS, Request

FROM_PRESET = "or the --config preset's"


# Ports and backends are checked while parsing, so that every command refuses a bad one before it
# reads a hostfile or a model, and the error names the flag as given (--port or --ring-port).
# The checks are imported when a command parses its flags, not by `mlxpipe --help`.


def tcp_port(value: int | None) -> int | None:
    """Typer callback: ``check_port``'s refusal as a bad value of the flag."""
    from mlxpipe.cluster.hostfile import check_port

    try:
        return check_port(value)
    except UsageError as e:
        raise typer.BadParameter(e.message) from None


def backend_name(value: str | None) -> str | None:
    """Typer callback: ``check_backend``'s refusal as a bad value of the flag."""
    from mlxpipe.cluster.hostfile import check_backend

    try:
        return check_backend(value)
    except UsageError as e:
        raise typer.BadParameter(e.message) from None


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``"10,12,8"`` -> ``(10, 12, 8)``."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--split {text!r}: expected comma-separated layer counts such as 10,12,8") from None


# --- what a command works on ---------------------------------------------------------

Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="Hub repo id or local directory.",
    show_default="the --config preset's, else the demo model",
)]
Revision = Annotated[str | None, typer.Option(
    "--revision", help="Hub branch, tag or commit.", show_default="main, or the --config preset's for its model"
)]
Hostfile = Annotated[Path | None, typer.Option(
    "--hostfile", help="mlx.launch hostfile (JSON or YAML).",
    show_default=f"{DEFAULT_HOSTFILE}: two local ranks",
)]
Strategy = Annotated[str | None, typer.Option(
    "--strategy",
    help="balanced (the busiest stage does the least work per token: the weight bytes each stage reads, rank 0's "
    "vocabulary head included) | even (mlx-lm's split: the same number of layers on every rank) | memory (by each "
    "host's memory).",
    show_default="the --config preset's, else memory when every host has memory_gb, else balanced",
)]
Split = Annotated[str | None, typer.Option(
    "--split", help="Layers per rank in rank order, e.g. 10,12,8 (rank 0 runs the LAST layers).",
    show_default="the --config preset's, else from --strategy",
)]
Tp = Annotated[int | None, typer.Option(
    "--tp",
    help="Tensor parallelism: each N consecutive hosts of the hostfile form one group that splits every layer "
    "of its stage (N = the number of hosts: one group, pure tensor parallelism). Faster single-conversation "
    "decode over RDMA links (JACCL); see docs/tensor-parallel.md.",
    show_default="the --config preset's, else 1: pipeline only", metavar="N",
)]
LayoutOption = Annotated[str | None, typer.Option(
    "--layout",
    help="auto: the layout the cost model predicts fastest for --workload, from the cluster's measured facts "
    "(`mlxpipe doctor --links` writes them beside the hostfile): a pipeline with each split strategy, --tp for "
    "each group size that fits, and both; without facts, a pipeline. pipeline: the split of --strategy, no cost "
    "model. See docs/layout.md.",
    show_default="auto, unless --tp or --split is given (by flag or --config preset)", metavar="auto|pipeline",
)]
WorkloadOption = Annotated[str | None, typer.Option(
    "--workload",
    help="What --layout auto and the balanced split weigh: chat (a 1,000-token prompt, 250 tokens out, one at a "
    "time: prefill and single-stream decode), agent (an 8,000-token prompt: long-prompt prefill), batch (many "
    "requests at once: aggregate throughput).",
    show_default="chat", metavar="chat|agent|batch",
)]
Config = Annotated[Path | None, typer.Option(
    "--config", help="A preset from configs/*.yaml; flags override it.", show_default="none"
)]
FleetFile = Annotated[Path | None, typer.Option(
    "--fleet",
    help="A fleet file (YAML): several models, each on its own hosts of --hostfile, under its own names, behind "
    "one endpoint; each entry takes the per-model options (layout, tp, draft-model, adapter-path, the prompt "
    "cache's sizes...), which are then refused as flags. See docs/serve.md.",
    show_default="none: the one --model",
)]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]

# --- generation: the Request's fields (mlx_lm.generate's options, by its names) ---------------

MaxTokens = Annotated[int | None, typer.Option(
    "--max-tokens", "-n", help="Most tokens to generate.", show_default=f"{DEFAULT_MAX_TOKENS}, {FROM_PRESET}"
)]
Temp = Annotated[float | None, typer.Option(
    "--temp", help="Sampling temperature; 0 is greedy.", show_default=f"{Request.temp:g}, {FROM_PRESET}"
)]
TopP = Annotated[float | None, typer.Option(
    "--top-p", help="Nucleus sampling threshold.", show_default=f"{Request.top_p:g}, {FROM_PRESET}"
)]
MinP = Annotated[float | None, typer.Option(
    "--min-p", help="Min-p sampling threshold.", show_default=f"{Request.min_p:g}, {FROM_PRESET}"
)]
Seed = Annotated[int | None, typer.Option(
    "--seed", help="Sampling seed, shared by every rank.", show_default="the --config preset's, else a random one",
)]
SystemPrompt = Annotated[str | None, typer.Option(
    "--system-prompt", help="System message for the chat template.", show_default=f"none, {FROM_PRESET}"
)]
IgnoreChatTemplate = Annotated[bool, typer.Option(
    "--ignore-chat-template", help="Feed the prompt as is, without the chat template."
)]
TopK = Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens only; 0 is off.")]
MinTokensToKeep = Annotated[int, typer.Option("--min-tokens-to-keep", help="Tokens min-p sampling always keeps.")]
XtcProbability = Annotated[float, typer.Option(
    "--xtc-probability", help="XTC sampling: the chance, at each token, to drop the likeliest."
)]
XtcThreshold = Annotated[float, typer.Option(
    "--xtc-threshold", help="XTC sampling: tokens above this probability may be dropped."
)]
ExtraEosToken = Annotated[list[str] | None, typer.Option(
    "--extra-eos-token", help="A token (or token id) that also ends the reply; repeat for several.",
    show_default="none",
)]
MaxKvSize = Annotated[int | None, typer.Option(
    "--max-kv-size", help="Keep at most this many tokens in each KV cache (a rotating cache).",
    show_default="none: unbounded",
)]
KvBits = Annotated[int | None, typer.Option(
    "--kv-bits", help="Quantize the KV cache to these bits (2, 3, 4, 5, 6 or 8).", show_default="none: no quantization"
)]
KvGroupSize = Annotated[int, typer.Option("--kv-group-size", help="Group size of KV-cache quantization.")]
QuantizedKvStart = Annotated[int, typer.Option(
    "--quantized-kv-start", help="With --kv-bits: quantize once a cache holds this many tokens."
)]
ChatTemplateConfig = Annotated[str | None, typer.Option(
    "--chat-template-config",
    help="Extra arguments of the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'.",
    show_default="none",
)]
UseDefaultChatTemplate = Annotated[bool, typer.Option(
    "--use-default-chat-template",
    help="A tokenizer without a chat template uses its default one (as mlx-lm; none in transformers >= 4.44).",
)]
PrefillResponse = Annotated[str | None, typer.Option(
    "--prefill-response", help="The start of the assistant's reply, which the model continues.", show_default="none"
)]

# --- launching the pipeline ---------------------------------------------------------------

Context = Annotated[int | None, typer.Option(
    "--context", help="Context length (tokens): what the fit check reserves KV cache for.",
    show_default=str(DEFAULT_CONTEXT),
)]
AdapterPath = Annotated[Path | None, typer.Option(
    "--adapter-path",
    help="LoRA adapters (mlx-lm's adapter_config.json and adapters.safetensors), at this path on every host; "
    "each rank loads only its own layers' adapters.",
    show_default="none",
)]
DraftModel = Annotated[str | None, typer.Option(
    "--draft-model",
    help="Speculative decoding: a small model with the same tokenizer drafts tokens, the pipeline verifies "
    "--num-draft-tokens of them in one pass through the stages. Each rank loads all of it: a hub repo id "
    "(fetched to every host before the launch) or a model directory at this path on every host.",
    show_default="none: no draft model",
)]
NumDraftTokens = Annotated[int, typer.Option(
    "--num-draft-tokens", help="With --draft-model: tokens drafted per verification pass."
)]
Backend = Annotated[str | None, typer.Option(
    "--backend",
    help="mlx.launch backend: ring (TCP), jaccl (Thunderbolt RDMA), jaccl-ring (ring over Thunderbolt RDMA), "
    "mpi, nccl (CUDA).",
    show_default=f"the --config preset's, else the hostfile's, else {DEFAULT_BACKEND}", callback=backend_name,
)]
PipelineMode = Annotated[str, typer.Option(
    "--pipeline", help="generic (any mlx-lm model with a layers list) or native (the model's own pipeline())."
)]
PrefillStepSize = Annotated[int | None, typer.Option(
    "--prefill-step-size",
    help="Prompt tokens per prefill chunk. On a pipeline a prompt's chunks flow through the stages one behind "
    "the other, so every host prefills at once: smaller chunks pipeline better, larger ones use each host better.",
    show_default=f"{PIPELINE_PREFILL_STEP} on a pipeline of 2 or more ranks, else mlx-lm's {MLX_LM_PREFILL_STEP}",
)]
RingPort = Annotated[int | None, typer.Option(
    "--port", help="First ring port.", show_default=f"{DEFAULT_PORT}; a free one when every rank is local",
    callback=tcp_port,
)]
Timeout = Annotated[float, typer.Option(
    "--timeout",
    help="Watchdog: seconds without progress before the run is ended. Ranks cut off from this machine "
    "stop themselves after as long (5 to 30 s).",
)]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Allow the model's own Python code to run (off by default)."
)]
FromController = Annotated[bool, typer.Option(
    "--from-controller", help="Hosts without internet: fetch on this machine once and send each host its own files."
)]
DecodeBatch = Annotated[int, typer.Option(
    "--decode-batch",
    help="Requests whose decode steps share one micro-batch (batched KV caches), so pipeline stages x this many "
    "requests are in flight. 1: one request per micro-batch. Models whose caches cannot be batched (quantized) use 1.",
)]
