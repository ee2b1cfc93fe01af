"""``mlxpipe serve``: the model kept up across the hosts behind OpenAI's, Anthropic's and Ollama's APIs."""

from __future__ import annotations

from typing import Annotated

import typer

from mlxpipe.cli._generation import RequestFlags, check_draft_flags, pipeline_config
from mlxpipe.cli._options import (
    FROM_PRESET,
    AdapterPath,
    Backend,
    ChatTemplateConfig,
    Config,
    DecodeBatch,
    FromController,
    Hostfile,
    KvBits,
    KvGroupSize,
    MaxKvSize,
    Model,
    NumDraftTokens,
    PrefillStepSize,
    QuantizedKvStart,
    Revision,
    Split,
    Strategy,
    Timeout,
    Tp,
    TrustRemoteCode,
    UseDefaultChatTemplate,
    parse_split,
    tcp_port,
)
from mlxpipe.defaults import (
    DEFAULT_CONTEXT,
    DEFAULT_DECODE_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_PORT,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_STEP_TIMEOUT,
)
from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, Request

Host = Annotated[str, typer.Option(
    "--host", help="Address the HTTP API listens on. Beyond loopback, set --api-key."
)]
HttpPort = Annotated[int, typer.Option("--port", help="HTTP port of the API.", callback=tcp_port)]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="MLXPIPE_API_KEY", show_envvar=True,
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health. Prefer the environment variable: "
    "a flag shows in the process list.",
    show_default="none: no key asked",
)]
MaxConcurrency = Annotated[int | None, typer.Option(
    "--max-concurrency", help="Requests computed at once: --decode-batch of them at each stage.",
    show_default="pipeline stages x --decode-batch",
)]
MaxQueue = Annotated[int, typer.Option(
    "--max-queue", help="Requests waiting for a slot, or for the ranks to load or relaunch; beyond them, 429."
)]
QueueTimeout = Annotated[float, typer.Option(
    "--queue-timeout",
    help="Seconds a request waits for the ranks to be ready (loading, relaunching) before it gets a 503.",
)]
MaxBodySize = Annotated[int, typer.Option(
    "--max-body-size", help="Largest request body, in bytes; a larger one gets a 413."
)]
MaxRestarts = Annotated[int, typer.Option(
    "--max-restarts", help="Relaunches after a rank fails before the server gives up."
)]
PromptCacheSize = Annotated[int, typer.Option(
    "--prompt-cache-size", help="Finished requests whose KV caches are kept for prefix reuse."
)]
DefaultMaxTokens = Annotated[int | None, typer.Option(
    "--max-tokens", "-n", help="Default max_tokens of a request.", show_default=f"{DEFAULT_MAX_TOKENS}, {FROM_PRESET}",
)]
ServeContext = Annotated[int | None, typer.Option(
    "--context", help="Context length (tokens): the fit check's KV reserve, and the longest prompt and "
    "reply a request may make.",
    show_default=f"the model's max_position_embeddings; {DEFAULT_CONTEXT} for the fit check",
)]
ServeDraftModel = Annotated[str | None, typer.Option(
    "--draft-model",
    help="Speculative decoding, as mlx_lm.server's: requests then run one at a time (it is not batched). "
    "A hub repo id (fetched to every host) or a model directory at this path on every host.",
    show_default="none: no draft model",
)]
RingPort = Annotated[int | None, typer.Option(
    "--ring-port", help="First port of the ranks' ring.",
    show_default=f"{DEFAULT_PORT}; a free one when every rank is local", callback=tcp_port,
)]


def serve(
    model: Model = None,
    hostfile: Hostfile = None,
    revision: Revision = None,
    strategy: Strategy = None,
    split: Split = None,
    tp: Tp = None,
    config: Config = None,
    host: Host = "127.0.0.1",
    port: HttpPort = 8080,
    api_key: ApiKey = None,
    max_concurrency: MaxConcurrency = None,
    decode_batch: DecodeBatch = DEFAULT_DECODE_BATCH,
    max_queue: MaxQueue = DEFAULT_MAX_QUEUE,
    queue_timeout: QueueTimeout = DEFAULT_QUEUE_TIMEOUT,
    max_body_size: MaxBodySize = DEFAULT_MAX_BODY_BYTES,
    max_restarts: MaxRestarts = DEFAULT_MAX_RESTARTS,
    prompt_cache_size: PromptCacheSize = DEFAULT_PROMPT_CACHE_SIZE,
    max_tokens: DefaultMaxTokens = None,
    max_kv_size: MaxKvSize = None,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = Request.kv_group_size,
    quantized_kv_start: QuantizedKvStart = Request.quantized_kv_start,
    chat_template_config: ChatTemplateConfig = None,
    use_default_chat_template: UseDefaultChatTemplate = False,
    context: ServeContext = None,
    adapter_path: AdapterPath = None,
    draft_model: ServeDraftModel = None,
    num_draft_tokens: NumDraftTokens = DEFAULT_NUM_DRAFT_TOKENS,
    backend: Backend = None,
    prefill_step_size: PrefillStepSize = None,
    ring_port: RingPort = None,
    timeout: Timeout = DEFAULT_STEP_TIMEOUT,
    trust_remote_code: TrustRemoteCode = False,
    from_controller: FromController = False,
) -> None:
    """Serve the model behind OpenAI's, Anthropic's and Ollama's APIs, with a browser page, until Ctrl-C.

    Plans, checks every host, downloads and loads once; then answers OpenAI's
    /v1/chat/completions, /v1/completions, /v1/responses and /v1/models, Anthropic's /v1/messages
    and Ollama's /api/chat and /api/generate (streaming or not). The page at / shows the cluster
    and lets you try the model in a browser; /health says the status. Requests that arrive while
    the ranks load wait for them. A failed rank ends the requests in flight with an error, and the
    pipeline is relaunched; a request that fails alone ends alone.

    Example: mlxpipe serve --port 8080
    """
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.launch.batch import check_decode_batch
    from mlxpipe.protocol.checks import at_least
    from mlxpipe.serve import server

    flags = RequestFlags.of(locals())
    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp)
    # A request's sampling comes from its body; the preset gives only max_tokens, as before.
    defaults = flags.request(Preset(max_tokens=target.preset.max_tokens))
    check_draft_flags(draft_model, max_kv_size)
    if draft_model is not None:
        if max_concurrency not in (None, 1):
            raise UsageError("--max-concurrency: with --draft-model requests run one at a time (speculative "
                             "decoding is not batched, as in mlx_lm.server)", "drop --max-concurrency")
        max_concurrency, decode_batch = 1, 1
    run_config = pipeline_config(
        target, backend=backend, prefill_step_size=prefill_step_size, port=ring_port, timeout=timeout,
        trust_remote_code=trust_remote_code, quiet=False, from_controller=from_controller, context=context,
        adapter_path=adapter_path, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
    )
    check_decode_batch(decode_batch)
    if max_concurrency is not None:
        at_least(max_concurrency, 1, "--max-concurrency")
    options = server.ServeOptions(
        max_concurrency=max_concurrency if max_concurrency is not None else run_config.concurrency(decode_batch),
        max_queue=max_queue, max_restarts=max_restarts, prompt_cache_size=prompt_cache_size,
        decode_batch=decode_batch, queue_timeout=queue_timeout,
    )
    code = server.serve(
        run_config, options, host=host, port=port, api_key=api_key,
        defaults=defaults, context=context, max_body_bytes=max_body_size,
    )
    raise typer.Exit(code)
