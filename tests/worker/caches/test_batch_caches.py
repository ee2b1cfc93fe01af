"""worker/caches/batch_caches.py: which models' caches can decode several requests in one micro-batch."""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.tiny_models import TinyModels
from mlxpipe.errors import UsageError
from mlxpipe.protocol.job import JobSpec


def test_models_whose_caches_cannot_be_batched_decode_one_request_per_micro_batch(tiny_models: TinyModels) -> None:
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.models.cache import ChunkedKVCache

    from mlxpipe.worker.caches.batch_caches import decode_batch_for

    class Chunked(nn.Module):  # llama4's attention chunks: a cache mlx-lm cannot merge
        def make_cache(self) -> list[Any]:
            return [ChunkedKVCache(8)]

    job = JobSpec(["x"], [1])
    model, _ = load(str(tiny_models["qwen2"]))
    assert decode_batch_for(model, job, 4) == 4
    assert decode_batch_for(model, JobSpec(["x"], [1], max_kv_size=16), 3) == 3  # rotating caches merge
    assert decode_batch_for(Chunked(), job, 4) == 1
    with pytest.raises(UsageError, match="decode_batch must be at least 1"):
        decode_batch_for(model, job, 0)
