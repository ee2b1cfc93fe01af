"""The defaults the command line shows and the core uses, each written once.

A leaf: it imports nothing of mlxpipe and nothing heavy, so ``mlxpipe --help`` shows every
default without loading the launch, plan or serve code that uses them; those modules import
them from here. A request's defaults (max tokens, sampling, KV cache) live with ``Request`` in
``protocol/request.py``, itself a leaf.
"""

from __future__ import annotations

from pathlib import Path

# --- what a command targets ---------------------------------------------------------------

DEFAULT_HOSTFILE = Path("hostfiles/local-2.json")  # two ranks on this machine, with the demo model
DEFAULT_BACKEND = "ring"  # mlx.launch's ring over TCP: works on any network
DEFAULT_CONTEXT = 4096  # tokens the fit check reserves KV cache for

# --- mlxpipe cluster ------------------------------------------------------------------------

DEFAULT_DISCOVER_TIMEOUT = 3.0  # seconds `cluster discover` listens for Bonjour answers (Macs answer within one)
DEFAULT_HOSTFILE_OUT = Path("cluster.json")  # where `cluster init` writes the hostfile

# --- a launch ------------------------------------------------------------------------------

DEFAULT_PORT = 32323  # mlx.launch's first ring port on real clusters (a free one when every rank is local)
DEFAULT_LOAD_TIMEOUT = 600.0  # seconds the ranks may take to load their shares
DEFAULT_STEP_TIMEOUT = 120.0  # the watchdog (--timeout): seconds without progress before a run is ended
DEFAULT_DECODE_BATCH = 4  # requests per decode micro-batch (--decode-batch); docs/generate.md, "Many prompts at once"
# How the model is cut into stages (``--pipeline``): mlxpipe's own cut of any mlx-lm model with a layers
# list, or the model's own ``pipeline()``.
PIPELINE_MODES = ("generic", "native")
MLX_LM_PREFILL_STEP = 2048  # mlx_lm.generate's --prefill-step-size
# A prompt's chunks flow through the stages one behind the other (the engine's pipelined prefill).
# Measured (docs/benchmarks.md, "Prefill"): a 600-token prompt on 2 ranks prefills at 21.8 tok/s in one 2048-token
# chunk, 33.8 in chunks of 256 and 39.7 in chunks of 128 (single process: 24.1).
PIPELINE_PREFILL_STEP = 128

# --- mlxpipe serve -------------------------------------------------------------------------

DEFAULT_MAX_QUEUE = 64  # requests waiting for a slot (or for the ranks); beyond them, 429
DEFAULT_MAX_RESTARTS = 3  # relaunches after a rank fails before the server gives up
DEFAULT_PROMPT_CACHE_SIZE = 10  # finished requests whose KV caches are kept for prefix reuse
# The prompt cache's disk tier: GB (10^9 bytes) each rank keeps in its folder, and that folder on a host with
# hf_home in the hostfile (else ~/.cache/mlxpipe/prompt-cache; $MLXPIPE_HOME/prompt-cache on this machine).
DEFAULT_PROMPT_CACHE_GB = 16.0
PROMPT_CACHE_UNDER_HF_HOME = "mlxpipe/prompt-cache"
DEFAULT_QUEUE_TIMEOUT = DEFAULT_LOAD_TIMEOUT  # a request waits for the ranks as long as they may take to load
# serve: a prefill chunk's tokens while other requests decode, so their streams keep going during a long prompt.
DEFAULT_PREFILL_BUDGET = 32
# A rank failed: seconds the requests it was computing wait for the relaunched pipeline to continue them.
DEFAULT_RESUME_TIMEOUT = 120.0
# SIGTERM: seconds the server keeps answering the requests in flight (taking no new ones) before it stops.
DEFAULT_DRAIN_SECONDS = 30.0
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # the largest request body; a larger one gets a 413
# What one image a client sends may be, and how many a request may hold (serve's --max-image-mb,
# --max-image-pixels, --max-images); here so the command line names them without importing the vision room.
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_IMAGES = 8
DEFAULT_IMAGE_URL_TIMEOUT = 10.0  # seconds an image URL may take to fetch, whole (serve --allow-image-urls)
