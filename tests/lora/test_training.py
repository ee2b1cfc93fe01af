"""lora/training.py: the controller's side of a training run, over a channel that loses a rank's event."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest


def test_a_rank_whose_adapters_are_lost_on_the_way_fails_the_save_instead_of_writing_without_them(
        tmp_path: Path) -> None:
    # mlx.launch merges the ranks' output in 8 KiB reads, so a long line can be cut by another
    # rank's output and lost. This cannot be made to happen on purpose with real ranks: the
    # channel here delivers rank 0's "adapter" event and loses rank 1's.
    import mlx.core as mx

    from mlxpipe.errors import LaunchError
    from mlxpipe.lora.adapters import ADAPTER_FILE
    from mlxpipe.lora.options import TrainOptions
    from mlxpipe.lora.training import Reporter, Training
    from mlxpipe.protocol.events import TRAIN_EVENTS
    from mlxpipe.protocol.messages import Save
    from mlxpipe.worker.training.train import encode_weights

    class Ranks:
        size = 2

        def __init__(self) -> None:
            self.sent: list[Any] = []

        def send(self, request: Any) -> None:
            self.sent.append(request)

        def events(self, timeout: float) -> Any:
            while not self.sent:
                yield TRAIN_EVENTS.from_wire({"event": "progress", "rank": 0, "what": "idle", "step": 0})
            ident = self.sent[0].id
            yield TRAIN_EVENTS.from_wire({"event": "adapter", "id": ident, "rank": 0,
                                          "data": encode_weights({"a": mx.zeros((2,))})})
            for rank in (0, 1):
                yield TRAIN_EVENTS.from_wire({"event": "done", "id": ident, "rank": rank, "kind": "save", "tensors": 1,
                                              "seconds": 0.1, "peak_memory": 0.0})

    ranks = Ranks()
    pipe = types.SimpleNamespace(ranks=ranks, events=ranks.events, config=types.SimpleNamespace(timeout=5.0),
                                 loaded={}, run_dir=tmp_path / "run")
    options = TrainOptions.build({"model": "m", "train": True, "adapter_path": str(tmp_path)})
    with pytest.raises(LaunchError, match="rank 1's adapters did not reach this machine whole"):
        Training(pipe, options, Reporter()).run(iter([Save(id=1, it=1, checkpoint=False)]))
    assert not (tmp_path / ADAPTER_FILE).exists()
