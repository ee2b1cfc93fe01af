"""serve/cluster_view.py: what the cluster's page is fed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from mlxpipe.serve.app import build_app
from mlxpipe.serve.cluster_view import History
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog
from mlxpipe.vision.images import ImageLimits


def test_the_history_is_a_bounded_ring_of_rates() -> None:
    history = History(size=3)
    history.sample(100.0, tokens=0, in_flight=0)
    history.sample(102.0, tokens=10, in_flight=2)
    history.sample(103.0, tokens=10, in_flight=1)
    history.sample(103.5, tokens=13, in_flight=1)
    assert [(s["t"], s["tps"], s["in_flight"]) for s in history.samples] == [(102.0, 5.0, 2), (103.0, 0.0, 1),
                                                                             (103.5, 6.0, 1)]


class _ReadyQueue(ScriptedQueue):
    """The scripted queue with what the page's data reads of a ready one: no ranks, no figures."""

    detail, tokens_out, ranks = None, 0, ()
    plan = SimpleNamespace(ranks=())

    def health(self) -> dict[str, Any]:
        return {"status": "ready", "restarts": 0, "ranks": []}


@pytest.mark.parametrize(("vision", "images"), [
    (None, None),
    (object(), {"max_bytes": 1024, "max_images": 3}),
])
def test_the_page_s_data_says_the_image_limits_where_the_model_takes_images(demo_model: Path, vision: object,
                                                                            images: dict[str, int] | None) -> None:
    tokenizer = load_tokenizer(demo_model)
    settings = ServerSettings(model_id="m", api_key=None, context=4096, vision=vision,  # type: ignore[arg-type]
                              image_limits=ImageLimits(max_bytes=1024, max_images=3))
    app = build_app(_ReadyQueue(tokenizer, "x"), tokenizer, settings, RequestLog())  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert client.get("/v1/cluster").json()["images"] == images
