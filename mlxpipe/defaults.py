"""Defaults that several rooms share, in one leaf that imports nothing of mlxpipe's.

The command line shows them in ``--help``; the launch code, the job and the ranks
use them. Kept apart so that ``mlxpipe --help`` loads no launch or worker code.
"""

from __future__ import annotations

# How the model is cut into stages (``--pipeline``): mlxpipe's own cut of any mlx-lm model with a layers
# list, or the model's own ``pipeline()``.
PIPELINE_MODES = ("generic", "native")

MLX_LM_PREFILL_STEP = 2048  # mlx_lm.generate's --prefill-step-size
# A prompt's chunks flow through the stages one behind the other (the engine's pipelined prefill).
# Measured (docs/benchmarks.md, "Prefill"): a 600-token prompt on 2 ranks prefills at 21.8 tok/s in one 2048-token
# chunk, 33.8 in chunks of 256 and 39.7 in chunks of 128 (single process: 24.1).
PIPELINE_PREFILL_STEP = 128
