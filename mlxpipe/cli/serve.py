"""``mlxpipe serve``: the model kept up across the hosts behind OpenAI's, Anthropic's and Ollama's APIs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated

import typer

from mlxpipe.cli._generation import check_draft_flags, settle_config
from mlxpipe.cli._groups import LaunchFlags, RequestFlags, Take, TargetFlags, option_groups
from mlxpipe.cli._options import FROM_PRESET, DecodeBatch, FleetFile, tcp_port
from mlxpipe.defaults import (
    DEFAULT_CONTEXT,
    DEFAULT_DECODE_BATCH,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_IMAGE_URL_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_PORT,
    DEFAULT_PREFILL_BUDGET,
    DEFAULT_PROMPT_CACHE_GB,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_RESUME_TIMEOUT,
    PROMPT_CACHE_UNDER_HF_HOME,
)
from mlxpipe.errors import UsageError
from mlxpipe.protocol.checks import at_least, positive
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.serve.queue import ServeOptions
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
PrefillBudget = Annotated[int, typer.Option(
    "--prefill-budget",
    help="Tokens of a prompt prefilled per step while other requests decode: each decoding stream waits for one "
         "such step between its tokens, so a long prompt slows them by at most that much, and itself takes more "
         "steps. Alone, a prompt is prefilled --prefill-step-size tokens at a time. 0: no bound.",
)]
ResumeTimeout = Annotated[float, typer.Option(
    "--resume-timeout",
    help="When a rank fails, the requests in flight pause while the pipeline relaunches, then go on where their "
         "clients left off (the prompt and the reply so far prefilled again). Seconds they wait for it before they "
         "end with the failure's root cause. 0: they end at once.",
)]
MaxBodySize = Annotated[int, typer.Option(
    "--max-body-size", help="Largest request body, in bytes; a larger one gets a 413."
)]
DrainSeconds = Annotated[float, typer.Option(
    "--drain-seconds",
    help="On SIGTERM: seconds the requests in flight have to finish, while new ones get a 503 with Retry-After; "
         "then the server stops. 0: SIGTERM stops at once, as Ctrl-C does.",
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
ServeRingPort = Annotated[int | None, typer.Option(
    "--ring-port", help="First port of the ranks' ring.",
    show_default=f"{DEFAULT_PORT}; a free one when every rank is local", callback=tcp_port,
)]


@dataclass(frozen=True)
class ServeFlags:
    """The server's own flags, as given: where it listens, whom it answers, and its limits."""

    host: Host = "127.0.0.1"
    port: HttpPort = 8080
    api_key: ApiKey = None
    served_model_name: ServedModelName = None
    any_model_name: AnyModelName = False
    max_concurrency: MaxConcurrency = None
    decode_batch: DecodeBatch = DEFAULT_DECODE_BATCH
    max_queue: MaxQueue = DEFAULT_MAX_QUEUE
    queue_timeout: QueueTimeout = DEFAULT_QUEUE_TIMEOUT
    resume_timeout: ResumeTimeout = DEFAULT_RESUME_TIMEOUT
    prefill_budget: PrefillBudget = DEFAULT_PREFILL_BUDGET
    max_body_size: MaxBodySize = DEFAULT_MAX_BODY_BYTES
    max_restarts: MaxRestarts = DEFAULT_MAX_RESTARTS
    drain_seconds: DrainSeconds = DEFAULT_DRAIN_SECONDS
    max_image_mb: MaxImageMb = DEFAULT_MAX_IMAGE_BYTES / MIB
    max_image_pixels: MaxImagePixels = DEFAULT_MAX_IMAGE_PIXELS / MEGAPIXEL
    max_images: MaxImages = DEFAULT_MAX_IMAGES
    allow_image_urls: AllowImageUrls = False
    image_url_timeout: ImageUrlTimeout = DEFAULT_IMAGE_URL_TIMEOUT
    prompt_cache_size: PromptCacheSize = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_gb: PromptCacheGb = DEFAULT_PROMPT_CACHE_GB
    prompt_cache_dir: PromptCacheDir = None

    def for_draft(self) -> ServeFlags:
        """With a draft model requests run one at a time, as in mlx_lm.server: no batch, no disk tier to keep
        (each request continues the last one's caches)."""
        if self.max_concurrency not in (None, 1):
            raise UsageError("--max-concurrency: with --draft-model requests run one at a time (speculative "
                             "decoding is not batched, as in mlx_lm.server)", "drop --max-concurrency")
        return replace(self, max_concurrency=1, decode_batch=1, prompt_cache_gb=0.0)

    def limits(self) -> ImageLimits:
        """What each image a request sends may be (checked, naming the flags)."""
        limits = image_limits(self.max_image_mb, self.max_image_pixels, self.max_images)
        positive(self.image_url_timeout, "--image-url-timeout")
        return limits

    def check(self) -> None:
        """The queue's flags, refused before the layout is settled (which may read the model)."""
        from mlxpipe.launch.batch import check_decode_batch

        check_decode_batch(self.decode_batch)
        if self.max_concurrency is not None:
            at_least(self.max_concurrency, 1, "--max-concurrency")

    def options(self, config: PipelineConfig) -> ServeOptions:
        """The request queue's options; ``--max-concurrency`` defaults to ``--decode-batch`` per stage of the
        layout that runs (``config`` settled)."""
        from mlxpipe.serve.queue import ServeOptions

        given = self.max_concurrency
        return ServeOptions(
            max_concurrency=given if given is not None else config.concurrency(self.decode_batch),
            max_queue=self.max_queue, max_restarts=self.max_restarts, prompt_cache_size=self.prompt_cache_size,
            decode_batch=self.decode_batch, queue_timeout=self.queue_timeout, prompt_cache_gb=self.prompt_cache_gb,
            prompt_cache_dir=self.prompt_cache_dir, drain_seconds=self.drain_seconds,
            resume_timeout=self.resume_timeout, prefill_budget=self.prefill_budget,
        )


@option_groups
def serve(
    *,
    target: TargetFlags,
    server: ServeFlags,
    request: Annotated[RequestFlags, Take(
        only=("max_tokens", "max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start", "chat_template_config",
              "use_default_chat_template"),
        max_tokens=DefaultMaxTokens,
    )],
    launch: Annotated[LaunchFlags, Take(
        drop=("pipeline_mode",), context=ServeContext, draft_model=ServeDraftModel, ring_port=ServeRingPort,
    )],
    fleet: FleetFile = None,
) -> None:
    """Serve the model behind OpenAI's, Anthropic's and Ollama's APIs, with a browser page, until Ctrl-C.

    Plans, checks every host, downloads and loads once; then answers OpenAI's
    /v1/chat/completions, /v1/completions, /v1/responses and /v1/models, Anthropic's /v1/messages
    and Ollama's /api/chat and /api/generate (streaming or not). The page at / shows the cluster
    and lets you try the model in a browser; /health says the status. Requests that arrive while
    the ranks load wait for them. When a rank fails the pipeline is relaunched, and the requests in
    flight pause meanwhile, then go on where their clients left off (--resume-timeout); a request
    that fails alone ends alone.

    Example: mlxpipe serve --port 8080
    """
    if fleet is not None:  # several models, each on its own hosts of --hostfile: the per-model flags are its entries'
        from mlxpipe.cli.fleet import serve_fleet

        raise typer.Exit(serve_fleet(fleet, target=target, server=server, request=request, launch=launch))
    from mlxpipe.cluster.presets import Preset
    from mlxpipe.serve import server as http

    limits = server.limits()
    the_target = target.target()
    # A request's sampling comes from its body; the preset gives only max_tokens, as before.
    defaults = request.request(Preset(max_tokens=the_target.preset.max_tokens))
    check_draft_flags(launch.draft_model, request.max_kv_size)
    if launch.draft_model is not None:
        server = server.for_draft()
    config = launch.config(the_target, quiet=False)
    server.check()
    config = settle_config(config, quiet=False)
    code = http.serve(
        config, server.options(config), host=server.host, port=server.port, api_key=server.api_key,
        defaults=defaults, context=launch.context, max_body_bytes=server.max_body_size,
        served_names=tuple(server.served_model_name or ()), any_model_name=server.any_model_name,
        image_limits=limits, image_url_timeout=server.image_url_timeout if server.allow_image_urls else None,
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
