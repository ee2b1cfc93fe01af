"""LoRA fine-tuning on one rank: its layers frozen, its own LoRA parameters and optimizer.

The model is cut exactly as for generation (``pipeline_generic``), with the
rank's ``Exchange`` made explicit: the first local layer takes the activations
received from rank + 1, the last one leaves its output to be sent to rank - 1.
Rank 0 runs the last layers, the head and mlx-lm's masked loss; the highest
rank the embeddings and the first layers.

Backward across stages: a stage differentiates ``sum(y * stop_gradient(dy))``
with respect to its LoRA parameters and its input, where ``dy`` is the
gradient received for its output ``y``; the input's gradient goes to rank + 1.
The whole graph of a micro-batch (the receive of ``dy`` included, lazily) is
built at its forward; the forward evaluates only ``y`` and sends it, and the
backward later evaluates the gradients from the activations kept since, so
nothing is computed twice. ``train_schedule`` says which micro-batch each
stage runs forward or backward, and when it receives a gradient; every send and
receive is evaluated on its own, so no rank waits on a receive across another
phase of work.

Requests (from the controller, ``mlxpipe.lora.run``), each answered by a ``done``
event from every rank: ``resume`` (adapter weights), ``step`` (one optimizer
step over a batch, cut into micro-batches), ``eval`` (validation loss),
``save`` (each rank's adapter weights, as ``adapter`` events), ``exit``.
"""

from __future__ import annotations

import base64
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlxpipe.errors import UsageError
from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Adapter, Bye, Progress, TrainDone
from mlxpipe.protocol.job import JobSpec, TrainSpec
from mlxpipe.protocol.messages import Eval, Exit, Resume, Save, Step, TrainMessage
from mlxpipe.worker.groups import init_group
from mlxpipe.worker.inbox import Inbox
from mlxpipe.worker.load import LoadedModel, barrier, flat_parameters, load_rank, loaded_event
from mlxpipe.worker.progress import PROGRESS_SECONDS, Emit
from mlxpipe.worker.stages.cut import find_exchange
from mlxpipe.worker.training.train_schedule import Action, stage_actions
from mlxpipe.worker.training.tuner import add_lora, build_optimizer, checkpoint_layers


def run(job_text: str, stream: IO[str] | None = None, emit: Emit = wire.emit) -> None:
    """Join the group, load this rank's layers with their LoRA adapters, then train on requests."""
    job = JobSpec.decode(job_text)
    assert job.train is not None  # worker.__main__ runs this for a training job only
    group = init_group(job.world_size)
    loaded = load_rank(job, group)
    stage = Stage(loaded, group, job.train)
    emit(loaded_event(job, group, loaded, trainable=stage.trainable_count, frozen=stage.frozen_count))
    Trainer(stage, emit).run(stream or sys.stdin)


def masked_loss_sum(logits: mx.array, batch: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``default_loss`` before its division: the summed masked cross-entropy and the token count.

    Sums, so that micro-batches add up to the whole batch's mean exactly.
    """
    targets = batch[:, 1:]
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    ce = nn.losses.cross_entropy(logits, targets) * mask
    return ce.astype(mx.float32).sum(), mask.sum()


def token_count(batch: mx.array, lengths: mx.array) -> mx.array:
    """The tokens the loss counts in ``batch`` (``default_loss``'s ``ntoks``)."""
    steps = mx.arange(1, batch.shape[1])
    return mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:]).sum()


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""

    value: mx.array
    aux: mx.array
    grads: tuple[Any, mx.array | None]
    dy: mx.array | None


class Stage:
    """This rank's part of the model, its LoRA parameters and optimizer, and the sends and receives."""

    def __init__(self, loaded: LoadedModel, group: mx.distributed.Group, options: TrainSpec) -> None:
        self.loaded, self.group, self.options = loaded, group, options
        self.model = loaded.model
        self.rank, self.size = group.rank(), group.size()
        self.index = self.size - 1 - self.rank  # stage 0 runs the first layers
        self.first, self.last = self.index == 0, self.rank == 0
        add_lora(self.model, loaded.config, options)
        if options.grad_checkpoint:
            checkpoint_layers(self.model)
        self.exchange = find_exchange(self.model)
        if self.exchange is not None:
            self.exchange.explicit = True
        self.optimizer = build_optimizer(options)
        self.trainable_count = sum(v.size for _, v in flat_parameters(self.model.trainable_parameters()))
        self.frozen_count = sum(v.size for _, v in flat_parameters(self.model.parameters())) - self.trainable_count
        self.backward_from = self._first_trained_stage()
        self.model.train()
        self._incoming: dict[tuple[int, ...], tuple[tuple[int, ...], mx.Dtype]] = {}
        self.on_action: Callable[[str], None] = lambda what: None  # progress, for the controller's watchdog
        self.compute_seconds = 0.0  # evaluating this stage's own work, not waiting on a send or receive

    @property
    def runs_backward(self) -> bool:
        return bool(self.index >= self.backward_from)

    @property
    def sends_grad(self) -> bool:
        return not self.first and self.index > self.backward_from

    def _first_trained_stage(self) -> int:
        """The first stage (from the input) holding LoRA parameters; stages before it run no backward."""
        mine = mx.zeros((self.size,)).at[self.index].add(float(self.trainable_count > 0))
        flags = mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu) if self.size > 1 else mine
        trained = [s for s, f in enumerate(cast(list[float], flags.tolist())) if f > 0]
        if not trained:
            raise UsageError("no layer has LoRA parameters", hint="raise --num-layers")
        return trained[0]

    # --- one stage's forward -----------------------------------------------------------

    def _run(self, inputs: mx.array, x: mx.array | None) -> mx.array:
        """The model on this rank: ``x`` into the first local layer; the logits (rank 0) or this stage's output."""
        if self.exchange is None:
            whole: mx.array = self.model(inputs)
            return whole
        self.exchange.hidden_in, self.exchange.hidden_out = x, None
        logits: mx.array = self.model(inputs)
        if self.last:
            return logits
        assert self.exchange.hidden_out is not None  # the last local layer left it there
        return self.exchange.hidden_out

    def _receive_input(self, inputs: mx.array) -> mx.array | None:
        """The activations from rank + 1 (lazy: received when evaluated); None on the first stage."""
        if self.first:
            return None
        key = tuple(inputs.shape)
        if key not in self._incoming:
            # The shape and dtype reaching the first local layer, from a graph never evaluated.
            self._run(inputs, None)
            assert self.exchange is not None and self.exchange.incoming is not None
            self._incoming[key] = self.exchange.incoming
        shape, dtype = self._incoming[key]
        return mx.distributed.recv(shape, dtype, self.rank + 1, group=self.group)

    def _send(self, y: mx.array, to: int) -> None:
        mx.eval(mx.distributed.send(y, to, group=self.group))

    def _compute(self, *arrays: Any) -> None:
        """Evaluate ``arrays``, all of whose receives have been evaluated: the stage's busy time."""
        tic = time.perf_counter()
        mx.eval(*arrays)
        self.compute_seconds += time.perf_counter() - tic

    # --- training ----------------------------------------------------------------------

    def train_step(self, batch: mx.array, lengths: mx.array, micro_batches: int, schedule: str) -> dict[str, Any]:
        """One optimizer step over ``batch`` cut into ``micro_batches``; rank 0 returns the loss."""
        rows = batch.shape[0] // micro_batches
        cuts = [(batch[i * rows:(i + 1) * rows], lengths[i * rows:(i + 1) * rows]) for i in range(micro_batches)]
        ntoks = token_count(batch, lengths) if self.last else None
        params = self.model.trainable_parameters()
        flight: dict[int, _InFlight] = {}
        grads: Any = None
        loss = mx.array(0.0)
        actions = stage_actions(schedule, self.size, self.index, micro_batches, self.backward_from)
        for action in actions:
            kind = "forward" if action.kind == "F" else "backward"
            self.on_action(f"{kind} of micro-batch {action.micro + 1}/{micro_batches}")
            mb, mb_lengths = cuts[action.micro]
            if action.kind == "F":
                done = self._forward(action, mb, mb_lengths, ntoks, params, flight)
                if done is not None:
                    loss = loss + done
            else:
                grads = self._backward(flight.pop(action.micro), grads)
        self.model.update(params)
        if grads is not None:
            self.optimizer.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, loss)
        out: dict[str, Any] = {}
        if self.last:
            assert ntoks is not None  # counted on the last stage
            out = {"loss": loss.item(), "ntoks": int(cast(int, ntoks.item())),
                   "learning_rate": float(self.optimizer.learning_rate.item())}
        return out

    def _forward(self, action: Action, mb: mx.array, lengths: mx.array, ntoks: mx.array | None,
                 params: Any, flight: dict[int, _InFlight]) -> mx.array | None:
        """Run F of one micro-batch; keep its gradient graph for B. Rank 0 returns its loss share."""
        inputs = mb[:, :-1]
        x = self._receive_input(inputs)
        if x is not None:
            mx.eval(x)  # waiting for rank + 1, apart from computing
        if not self.runs_backward:
            y = self._run(inputs, x)
            self._compute(y)
            self._send(y, self.rank - 1)
            return None
        holder: dict[str, mx.array] = {}

        def objective(p: Any, x_in: mx.array | None) -> tuple[mx.array, mx.array]:
            self.model.update(p)
            out = self._run(inputs, x_in)
            if self.last:
                assert ntoks is not None  # counted on the last stage
                loss_sum, count = masked_loss_sum(out, mb, lengths)
                return loss_sum / ntoks, count
            dy = mx.distributed.recv_like(out, self.rank - 1, group=self.group)
            holder["dy"] = dy
            return (out * mx.stop_gradient(dy)).sum(), out

        if x is None:
            (value, aux), g = mx.value_and_grad(lambda p: objective(p, None))(params)
            grads: tuple[Any, mx.array | None] = (g, None)
        else:
            (value, aux), (g, gx) = mx.value_and_grad(objective, argnums=(0, 1))(params, x)
            grads = (g, gx)
        self.model.update(params)
        state = _InFlight(value, aux, grads, holder.get("dy"))
        flight[action.micro] = state
        if self.last:
            self._compute(value)
            return value
        self._compute(aux)  # this stage's output: the forward, now
        if action.grad_first is not None:
            waiting = flight[action.grad_first].dy
            assert waiting is not None
            mx.eval(waiting)  # the gradient the next backward needs, before our send (see train_schedule)
        self._send(aux, self.rank - 1)
        return None

    def _backward(self, state: _InFlight, grads: Any) -> Any:
        """Run B of one micro-batch: its gradients, added to ``grads``; the input's gradient sent upstream."""
        g, gx = state.grads
        if state.dy is not None:
            mx.eval(state.dy)  # waiting for rank - 1 (at once when received ahead)
        total = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
        if self.sends_grad and gx is not None:
            self._compute(total, gx)
            self._send(gx, self.rank + 1)
        else:
            self._compute(total)
        return total

    # --- validation --------------------------------------------------------------------

    def evaluate(self, batches: list[tuple[mx.array, mx.array]]) -> dict[str, Any]:
        """Forward only over ``batches``; rank 0 returns the summed loss and tokens (mlx-lm's ``evaluate``)."""
        self.model.eval()
        total, count = mx.array(0.0), mx.array(0)
        for batch, lengths in batches:
            inputs = batch[:, :-1]
            x = self._receive_input(inputs)
            if x is not None:
                mx.eval(x)
            out = self._run(inputs, x)
            if self.last:
                loss_sum, n = masked_loss_sum(out, batch, lengths)
                total, count = total + loss_sum, count + n
                self._compute(total, count)
            else:
                self._compute(out)
                self._send(out, self.rank - 1)
        self.model.train()
        return {"loss_sum": total.item(), "ntoks": int(cast(int, count.item()))} if self.last else {}

    # --- adapters ----------------------------------------------------------------------

    def adapter_weights(self) -> dict[str, mx.array]:
        """This rank's adapter parameters, under the names single-process mlx-lm gives them."""
        return dict(flat_parameters(self.model.trainable_parameters()))

    def load_adapters(self, weights: dict[str, mx.array]) -> int:
        """Take the entries of ``weights`` for this rank's parameters (``--resume-adapter-file``)."""
        mine = self.adapter_weights()
        found = [(k, v) for k, v in weights.items() if k in mine]
        for k, v in found:
            if v.shape != mine[k].shape:
                raise UsageError(
                    f"the adapter file's {k} has shape {tuple(v.shape)}, this model's {tuple(mine[k].shape)}",
                    hint="resume with the same model and --num-layers / lora_parameters",
                )
        self.model.load_weights(found, strict=False)
        mx.eval(self.model.parameters())
        return len(found)


class Trainer:
    """The loop of one training rank: each message answered by a ``done`` event, until ``exit``."""

    def __init__(self, stage: Stage, emit: Emit = wire.emit) -> None:
        self.stage, self._emit = stage, emit
        self.rank, self.host = stage.rank, socket.gethostname()
        self._actions, self._reported = 0, time.monotonic()
        self._request = ""
        stage.on_action = self._progress

    def _progress(self, what: str) -> None:
        """A ``progress`` event at most every PROGRESS_SECONDS: a long step is not a stalled one."""
        self._actions += 1
        now = time.monotonic()
        if now - self._reported >= PROGRESS_SECONDS:
            self._reported = now
            self._emit(Progress(rank=self.rank, what=f"{self._request}: {what}", step=self._actions))

    def run(self, stream: IO[str]) -> None:
        """Answer the messages from ``stream`` until ``exit`` or end of input."""
        inbox = Inbox(stream)
        while True:
            message = inbox.next()
            if message is None or isinstance(message, Exit):
                barrier(self.stage.group)
                self._emit(Bye(rank=self.rank, host=self.host))
                return
            if not isinstance(message, (Resume, Step, Eval, Save)):
                raise UsageError(f"a {message.TAG!r} message to a training rank")
            tic = time.perf_counter()
            it = message.it if isinstance(message, (Step, Eval, Save)) else None
            self._request = f"{message.TAG} {it or ''}".strip()
            found = self._answer(message)
            self._emit(TrainDone(id=message.id, kind=message.TAG, rank=self.rank, host=self.host,
                                 seconds=time.perf_counter() - tic, peak_memory=mx.get_peak_memory() / 1e9, **found))

    def _answer(self, message: TrainMessage) -> dict[str, Any]:
        """Do what ``message`` asks; what it found, as ``TrainDone``'s fields."""
        if isinstance(message, Step):
            return self._step(message)
        if isinstance(message, Eval):
            return self.stage.evaluate([(mx.array(b, mx.int32), mx.array(n, mx.int32)) for b, n in message.batches])
        if isinstance(message, Save):
            weights = self.stage.adapter_weights()
            self._emit(Adapter(id=message.id, rank=self.rank, data=encode_weights(weights)))
            return {"tensors": len(weights)}
        return {"loaded": self.stage.load_adapters(decode_weights(message.data))}

    def _step(self, message: Step) -> dict[str, Any]:
        batch, lengths = mx.array(message.batch, mx.int32), mx.array(message.lengths, mx.int32)
        if batch.shape[0] % message.micro_batches:
            raise UsageError(f"a batch of {batch.shape[0]} cannot be cut into {message.micro_batches} micro-batches")
        before = self.stage.compute_seconds
        found = self.stage.train_step(batch, lengths, message.micro_batches, message.schedule)
        return {"it": message.it, "compute_seconds": self.stage.compute_seconds - before, **found}


def encode_weights(weights: dict[str, mx.array]) -> str:
    """``weights`` as base64 safetensors bytes, for an event line."""
    if not weights:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.safetensors")
        mx.save_safetensors(path, weights)
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()


def decode_weights(data: str) -> dict[str, mx.array]:
    """``encode_weights``' inverse."""
    if not data:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.safetensors")
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        weights = cast(dict[str, mx.array], mx.load(path))  # a .safetensors file: a dict of arrays
        mx.eval(weights)
        return dict(weights)

