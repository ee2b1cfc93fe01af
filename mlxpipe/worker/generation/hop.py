"""The hidden state's hop between stages in the engine: what this stage receives from stage + 1, what it sends on.

One request's generation lets the cut model's boundary layers receive and send
themselves. The engine's ticks move the states between micro-batches of
different requests, so for the engine's run the rank's ``Exchange`` is made
explicit (``stages.stage.Exchange``): the first local layer takes the state
handed in, the last one leaves its output, and the ``Hop`` moves them. It learns
once what arrives (its shape and dtype, from a lazy call never evaluated: the
model decides, gemma3n's AltUp streams leading the batch axis, a block's extra
outputs packed with the state), and, for a vision-language model whose
language model takes position ids, packs each micro-batch's position ids into
the same message as its hidden state, so that the two never cross in another
order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlxpipe.worker.generation.vision_inputs import POSITION_BYTES, pack_positions, unpack_positions
from mlxpipe.worker.groups import Topology
from mlxpipe.worker.stages.cut import find_exchange
from mlxpipe.worker.stages.stage import Exchange


class Hop:
    """This stage's hand-over of hidden states to and from its neighbours, as the engine's ticks run them."""

    def __init__(self, model: nn.Module, topology: Topology, first: bool, positions: bool) -> None:
        """``first``: this is the first stage (the highest rank, which receives nothing); ``positions``: the
        position ids travel packed with the hidden state."""
        self.model, self.topology = model, topology
        self.first, self.positions = first, positions
        self.exchange: Exchange | None = find_exchange(model)
        self.positions_in: mx.array | None = None  # received with the hidden state of this tick's micro-batch

    @contextmanager
    def explicit(self) -> Iterator[None]:
        """The engine's run: the exchange explicit (the hop moves the states), then as it was."""
        if self.exchange is not None:
            self.exchange.explicit = True
        try:
            yield
        finally:
            if self.exchange is not None:
                self.exchange.explicit = False
                self.exchange.hidden_in = self.exchange.hidden_out = None

    def probe(self) -> None:
        """Learn the shape and dtype of the hidden state this rank receives.

        One lazy call on throwaway caches, never evaluated: the first local
        layer notes what arrives there (the stand-ins pass the embedding on).
        """
        if self.exchange is None or self.first:
            return
        self.exchange.hidden_in = None
        self.model(mx.array([[0]]), cache=make_prompt_cache(self.model))
        if self.exchange.incoming is None:
            raise RuntimeError("the pipeline's first local layer was never called")

    def enter(self, hidden_in: mx.array | None) -> None:
        """What this tick's micro-batch enters the stage's first local layer with (None: the embedding's)."""
        if self.exchange is not None:
            self.exchange.hidden_in, self.exchange.hidden_out = hidden_in, None

    def outgoing(self, extra: dict[str, Any]) -> mx.array:
        """What this stage sends on after its layers ran (lazy): the last local layer's output, with the position
        ids of the micro-batch (among its ``extra`` inputs) packed in when they travel."""
        assert self.exchange is not None and self.exchange.hidden_out is not None
        hidden_out = self.exchange.hidden_out
        if self.positions:
            hidden_out = pack_positions(hidden_out, extra["position_ids"])
        return hidden_out

    def send(self, hidden_out: mx.array) -> None:
        """``outgoing``'s message (evaluated) to the next stage (stage - 1)."""
        mx.eval(self.topology.send_down(hidden_out))

    def receive(self, rows: int, width: int) -> mx.array:
        """The hidden state of a micro-batch of ``rows`` rows of ``width`` tokens, from stage + 1, evaluated (its
        position ids, when they travel, in ``positions_in``)."""
        shape, dtype = self._incoming_shape(rows, width)
        if self.positions:  # the position ids come packed with the hidden state
            per_token = math.prod(shape) * dtype.size // (rows * width)
            message = self.topology.recv_up((rows, width, per_token + POSITION_BYTES), mx.uint8)
            hidden, self.positions_in = unpack_positions(message, shape, dtype)
            mx.eval(hidden, self.positions_in)
        else:
            hidden = self.topology.recv_up(shape, dtype)
            mx.eval(hidden)
        return hidden

    def _incoming_shape(self, rows: int, num_tokens: int) -> tuple[tuple[int, ...], mx.Dtype]:
        assert self.exchange is not None
        shape, dtype = self.exchange.incoming_shape(num_tokens)
        # The batch axis comes just before the tokens' (gemma3n's AltUp streams lead: (4, batch,
        # tokens, hidden)); a packed message is (batch, tokens, bytes).
        axis = 0 if self.exchange.incoming_layout is not None else self.exchange.token_axis - 1
        return (*shape[:axis], rows, *shape[axis + 1 :]), dtype
