"""What this machine reaches running real transformer layers (``mlxpipe doctor --links --calibrate``).

A published memory bandwidth or a square matrix product's rate is not what a model's layers get:
a decode step reads each weight once through many small kernels, a prompt chunk multiplies
tall-skinny matrices, and every layer costs some fixed time whatever its size (dispatching its
operations, its norms and its Python). So this times mlx-lm's own qwen2 layers, with random weights
built in memory (no download), at two widths and two depths, and takes apart:

* ``layer_overhead``: a narrow layer's time (its bytes read in next to no time);
* ``decode_bandwidth``: a wide layer's weight bytes over its decode time, the overhead taken off;
* ``prefill_flops``: a wide layer's FLOPs on a 128-token chunk over its time, the overhead taken off;
* ``step_overhead``: what a forward pass costs beyond its layers (embedding, final norm, the small
  head, the graph's evaluation).

A layer's time is the slope of a model's time over its depth (1, 2 and 4 layers, least squares),
each time the best of a few runs after a warm-up (the machine's own speed, without the pauses another
process's work puts in some runs).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2
from mlx_lm.models.cache import make_prompt_cache

CHUNK = 128  # the pipeline's prefill chunk (defaults.PIPELINE_PREFILL_STEP)
DEPTHS = (1, 2, 4)  # layers of the models timed: the time per layer is the slope
CONTEXT = 64  # tokens already in the cache when the decode steps are timed
RUNS = 7
CHUNK_RUNS = 3
NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
# Wide enough that reading the weights dwarfs the fixed costs: a CPU's float32 (~25 MB a layer), a Mac's
# float16 (a 7B model's layer, ~400 MB).
WIDE_CPU = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12, "num_key_value_heads": 4}
WIDE_GPU = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 8}


def calibrate_layers(dtype: Any, gpu: bool) -> dict[str, float]:
    """``plan.facts.Calibration``'s fields, measured here (see the module docstring)."""
    wide = WIDE_GPU if gpu else WIDE_CPU
    narrow = [_model(NARROW, n, dtype) for n in DEPTHS]
    models = [_model(wide, n, dtype) for n in DEPTHS]
    step_overhead, narrow_layer = _fit([_decode_step(m) for m in narrow])
    _, decode_layer = _fit([_decode_step(m) for m in models])
    _, chunk_layer = _fit([_chunk(m) for m in models])
    nbytes, narrow_bytes = _layer_bytes(models[0]), _layer_bytes(narrow[0])
    # A narrow layer reads next to nothing: its time is the fixed cost, less the little its bytes take.
    bandwidth = nbytes / max(decode_layer - narrow_layer, 1e-9)
    layer_overhead = max(narrow_layer - narrow_bytes / bandwidth, 0.0)
    bandwidth = nbytes / max(decode_layer - layer_overhead, 1e-9)
    flops = CHUNK * (2 * nbytes / _itemsize(dtype) + 4 * wide["hidden_size"] * (CHUNK / 2))
    return {"decode_bandwidth": bandwidth, "prefill_flops": flops / max(chunk_layer - layer_overhead, 1e-9),
            "layer_overhead": layer_overhead, "step_overhead": max(step_overhead, 0.0)}


def _fit(times: list[float]) -> tuple[float, float]:
    """The least-squares line through (depth, time) for ``DEPTHS``: (the time of no layer, the time of one more)."""
    n = len(DEPTHS)
    mean_x, mean_y = sum(DEPTHS) / n, sum(times) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(DEPTHS, times, strict=True))
             / sum((x - mean_x) ** 2 for x in DEPTHS))
    return mean_y - slope * mean_x, slope


def _model(dims: dict[str, int], layers: int, dtype: Any) -> Any:
    args = qwen2.ModelArgs(model_type="qwen2", num_hidden_layers=layers, rms_norm_eps=1e-5, vocab_size=320,
                           tie_word_embeddings=True, hidden_size=dims["hidden_size"],
                           intermediate_size=dims["intermediate_size"], num_attention_heads=dims["num_attention_heads"],
                           num_key_value_heads=dims["num_key_value_heads"])
    model = qwen2.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _layer_bytes(model: Any) -> int:
    """One layer's weight bytes."""
    weights: Any = tree_flatten(model.model.layers[0].parameters())  # [(name, array)], typed loosely by mlx
    return sum(int(v.nbytes) for _, v in weights)


def _itemsize(dtype: Any) -> int:
    return int(mx.zeros((1,), dtype).itemsize)


def _decode_step(model: Any) -> float:
    """The best time of one-token decode steps after ``CONTEXT`` tokens."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, CONTEXT), mx.int32), cache=cache))
    token = mx.array([[7]])
    times = []
    for _ in range(RUNS + 1):
        tic = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - tic)
    return min(times[1:])


def _chunk(model: Any) -> float:
    """The best time of a ``CHUNK``-token prompt chunk into an empty cache: every layer's output and cache (a
    pipeline stage sends its last layer's on), not the head's."""
    times = []
    for _ in range(CHUNK_RUNS + 1):
        cache = make_prompt_cache(model)
        tic = time.perf_counter()
        hidden = model.model(mx.zeros((1, CHUNK), mx.int32), cache=cache)
        mx.eval(hidden, [c.state for c in cache])
        times.append(time.perf_counter() - tic)
    return min(times[1:])
