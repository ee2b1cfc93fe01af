"""``mlxpipe serve``: the model kept up across the hosts behind OpenAI's, Anthropic's and Ollama's APIs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from mlxpipe.cli._generation import RequestFlags, check_draft_flags, pipeline_config, settle_config
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
    LayoutOption,
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
    WorkloadOption,
    parse_split,
    tcp_port,
)
from mlxpipe.defaults import (
    DEFAULT_CONTEXT,
    DEFAULT_DECODE_BATCH,
    DEFAULT_IMAGE_URL_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_PORT,
    DEFAULT_PROMPT_CACHE_GB,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_STEP_TIMEOUT,
    PROMPT_CACHE_UNDER_HF_HOME,
)
from mlxpipe.errors import UsageError
from mlxpipe.protocol.checks import at_least, positive
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, Request

if TYPE_CHECKING:
    from mlxpipe.vision.images import ImageLimits

MIB = 1024 * 1024
MEGAPIXEL = 1_000_000

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
    "--prompt-cache-size", help="Finished requests whose KV caches are kept in memory for prefix reuse."
)]
PromptCacheGb = Annotated[float, typer.Option(
    "--prompt-cache-gb",
    help="The prompt cache on disk: GB each rank keeps of its own slice of finished requests' KV caches, "
    "least recently used out; it survives restarts. 0: none.",
)]
PromptCacheDir = Annotated[str | None, typer.Option(
    "--prompt-cache-dir",
    help="Where each rank keeps the prompt cache on disk, at this path on every host.",
    show_default=f"<hf_home>/{PROMPT_CACHE_UNDER_HF_HOME} on a host with hf_home in the hostfile, else "
    "~/.cache/mlxpipe/prompt-cache ($MLXPIPE_HOME/prompt-cache on this machine)",
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
ServedModelName = Annotated[list[str] | None, typer.Option(
    "--served-model-name",
    help="Another name the model answers to (as vLLM's flag; repeat it for more), listed by /v1/models "
    "and Ollama's tags: the name an agent is configured with.",
    show_default="none: only the --model value",
)]
AnyModelName = Annotated[bool, typer.Option(
    "--any-model-name",
    help="Answer every model name with this model (agents ask for their own: a default, a small fast model "
    "for titles); each new name is said once in the output.",
)]
MaxImageMb = Annotated[float, typer.Option(
    "--max-image-mb", help="Largest image a request may send, in MiB (after base64 decoding); a larger one gets a 400."
)]
MaxImagePixels = Annotated[float, typer.Option(
    "--max-image-pixels", help="Largest image a request may send, in megapixels (width x height); a larger one "
    "gets a 400."
)]
MaxImages = Annotated[int, typer.Option(
    "--max-images", help="Most images one request may send; more get a 400."
)]
AllowImageUrls = Annotated[bool, typer.Option(
    "--allow-image-urls",
    help="Fetch the http(s) image URLs a request sends (OpenAI's image_url, Responses' input_image, Anthropic's "
    "url sources), each up to --max-image-mb within --image-url-timeout. Off: such a URL gets a 400; the server "
    "then fetches nothing for a client.",
)]
ImageUrlTimeout = Annotated[float, typer.Option(
    "--image-url-timeout", help="Seconds an image URL may take to fetch, whole, with --allow-image-urls; "
    "longer gets a 400."
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
    layout: LayoutOption = None,
    workload: WorkloadOption = None,
    config: Config = None,
    host: Host = "127.0.0.1",
    port: HttpPort = 8080,
    api_key: ApiKey = None,
    served_model_name: ServedModelName = None,
    any_model_name: AnyModelName = False,
    max_concurrency: MaxConcurrency = None,
    decode_batch: DecodeBatch = DEFAULT_DECODE_BATCH,
    max_queue: MaxQueue = DEFAULT_MAX_QUEUE,
    queue_timeout: QueueTimeout = DEFAULT_QUEUE_TIMEOUT,
    max_body_size: MaxBodySize = DEFAULT_MAX_BODY_BYTES,
    max_restarts: MaxRestarts = DEFAULT_MAX_RESTARTS,
    max_image_mb: MaxImageMb = DEFAULT_MAX_IMAGE_BYTES / MIB,
    max_image_pixels: MaxImagePixels = DEFAULT_MAX_IMAGE_PIXELS / MEGAPIXEL,
    max_images: MaxImages = DEFAULT_MAX_IMAGES,
    allow_image_urls: AllowImageUrls = False,
    image_url_timeout: ImageUrlTimeout = DEFAULT_IMAGE_URL_TIMEOUT,
    prompt_cache_size: PromptCacheSize = DEFAULT_PROMPT_CACHE_SIZE,
    prompt_cache_gb: PromptCacheGb = DEFAULT_PROMPT_CACHE_GB,
    prompt_cache_dir: PromptCacheDir = None,
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
    from mlxpipe.serve import server

    flags = RequestFlags.of(locals())
    limits = image_limits(max_image_mb, max_image_pixels, max_images)
    positive(image_url_timeout, "--image-url-timeout")
    target = resolve_target(model, revision, hostfile, strategy, parse_split(split), config, tp, layout, workload)
    # A request's sampling comes from its body; the preset gives only max_tokens, as before.
    defaults = flags.request(Preset(max_tokens=target.preset.max_tokens))
    check_draft_flags(draft_model, max_kv_size)
    if draft_model is not None:
        if max_concurrency not in (None, 1):
            raise UsageError("--max-concurrency: with --draft-model requests run one at a time (speculative "
                             "decoding is not batched, as in mlx_lm.server)", "drop --max-concurrency")
        max_concurrency, decode_batch = 1, 1
        prompt_cache_gb = 0.0  # requests continue the last one's caches (worker.generation.streamed): no tier to keep
    run_config = pipeline_config(
        target, backend=backend, prefill_step_size=prefill_step_size, port=ring_port, timeout=timeout,
        trust_remote_code=trust_remote_code, quiet=False, from_controller=from_controller, context=context,
        adapter_path=adapter_path, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
    )
    check_decode_batch(decode_batch)
    if max_concurrency is not None:
        at_least(max_concurrency, 1, "--max-concurrency")
    run_config = settle_config(run_config, quiet=False)
    options = server.ServeOptions(
        max_concurrency=max_concurrency if max_concurrency is not None else run_config.concurrency(decode_batch),
        max_queue=max_queue, max_restarts=max_restarts, prompt_cache_size=prompt_cache_size,
        decode_batch=decode_batch, queue_timeout=queue_timeout, prompt_cache_gb=prompt_cache_gb,
        prompt_cache_dir=prompt_cache_dir,
    )
    code = server.serve(
        run_config, options, host=host, port=port, api_key=api_key,
        defaults=defaults, context=context, max_body_bytes=max_body_size,
        served_names=tuple(served_model_name or ()), any_model_name=any_model_name, image_limits=limits,
        image_url_timeout=image_url_timeout if allow_image_urls else None,
    )
    raise typer.Exit(code)


def image_limits(max_image_mb: float, max_image_pixels: float, max_images: int) -> ImageLimits:
    """The limits every image a request sends is checked against, from ``--max-image-mb``, ``--max-image-pixels``
    (megapixels) and ``--max-images``."""
    from mlxpipe.vision.images import ImageLimits

    positive(max_image_mb, "--max-image-mb")
    positive(max_image_pixels, "--max-image-pixels")
    at_least(max_images, 1, "--max-images")
    # At least one byte and one pixel: a tiny positive value still means "some image", never "none at all".
    return ImageLimits(max_bytes=max(1, int(max_image_mb * MIB)), max_pixels=max(1, int(max_image_pixels * MEGAPIXEL)),
                       max_images=max_images)
