"""worker/generation/engine.py in one process (a group of one): the overlapped, batched request loop."""

from __future__ import annotations

import json
from typing import Any

from fixtures.pipeline_reference import PREFILL_STEP, request_reference
from fixtures.tiny_models import TINY_SPLITS, TinyModels
from mlxpipe.protocol.job import JobSpec


def test_an_unbatchable_model_runs_one_request_per_decode_micro_batch(tiny_models: TinyModels) -> None:
    """One process (a group of one): the engine falls back to B = 1, and tokens still match mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxpipe.protocol.messages import Batch
    from mlxpipe.worker.generation.loop import RankLoop
    from mlxpipe.worker.load import load_rank

    class Unmergeable(KVCache):  # as a cache mlx-lm cannot batch (quantized, chunked)
        def __getattribute__(self, name: str) -> Any:
            if name == "merge":
                raise AttributeError(name)
            return super().__getattribute__(name)

    path = tiny_models["qwen2"]
    job = JobSpec([str(path)], [sum(TINY_SPLITS["qwen2"][0])], prefill_step_size=PREFILL_STEP)
    loaded = load_rank(job, mx.distributed.init())
    loaded.model.make_cache = lambda: [Unmergeable() for _ in loaded.model.layers]
    events: list[dict[str, Any]] = []
    server = RankLoop(loaded, mx.distributed.init(), job, emit=lambda event: events.append(event.to_wire()))
    requests = [{"id": text, "prompt": text, "ignore_chat_template": True, "max_tokens": 4}
                for text in ("Hi", "Go", "Up")]
    done = server.generate_batch(Batch.from_wire({"type": "batch", "requests": requests, "concurrency": 3,
                                                  "decode_batch": 3}))
    assert done.decode_batch == 1
    results = {e["id"]: e for e in events if e["event"] == "result"}
    for request in requests:
        assert results[request["id"]]["tokens"] == request_reference(str(path), json.dumps(request, sort_keys=True))[0]
