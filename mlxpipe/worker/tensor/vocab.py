"""The vocabulary head and the embedding, split by vocabulary across a tensor group.

mlx-lm's ``shard()`` leaves both whole on every member; the head is one of the
largest matrices a token goes through. Both splits are exact:

* the head: each member computes the logits of its rows of the vocabulary and
  the group gathers them in member order (no sum is reordered);
* the embedding: each member looks up the tokens in its rows, zeros for the
  others, and the group adds them up: one member alone is non-zero, and adding
  zeros is exact. A tied head (``embed_tokens.as_linear``) uses the same rows.

Plain and quantized layers alike (``nn.Linear``/``nn.Embedding``,
``nn.QuantizedLinear``/``nn.QuantizedEmbedding``: mlx-community's 4-bit
models): a quantized row is its packed weights and its groups' scales and
biases, all indexed by the vocabulary row, so a member keeps the same rows of
each and the same ``mode``, ``bits`` and ``group_size``; its logits and
embeddings are bit for bit the whole layer's rows.

A vocabulary that does not divide by the group's size stays whole. In a
pipeline the engine's ticks (the ``Exchange`` made explicit) read only stage
0's logits: the head of another stage computes nothing there (its group's
exchanges run as they are built, whether or not their result is used, see
``worker.groups``) and gives zeros of the logits' shape, which nothing reads.
A forward pass that is not explicit (mlx-lm's ``stream_generate``: speculative
decoding, ``--draft-model``) hands world rank 0's hidden state to every rank,
and every rank samples its own tokens from its own logits: there every stage's
head computes them, on the same hidden state with the same rows, so every
stage holds stage 0's logits bit for bit (``follow_exchange``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.worker.groups import TensorGroup

if TYPE_CHECKING:
    from mlxpipe.worker.stages.stage import Exchange

_HEAD_NAMES = ("lm_head", "output", "head")
_HEADS = (nn.Linear, nn.QuantizedLinear)
_EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
# The arrays indexed by vocabulary row (a quantized layer's ``biases`` may be None: modes without them).
_ROW_ARRAYS = ("weight", "scales", "biases", "bias")
# A quantized layer's settings, which its rows keep.
_SETTINGS = ("group_size", "bits", "mode", "dims")


def _take_rows(layer: nn.Module, source: nn.Module, tensor: TensorGroup) -> None:
    """Make ``layer`` hold this member's rows of ``source`` (every row-indexed array) and its settings."""
    nn.Module.__init__(layer)
    vocab = source.weight.shape[0]
    rows = vocab // tensor.size()
    layer.offset, layer.rows, layer.vocab, layer.tensor = tensor.rank() * rows, rows, vocab, tensor
    for key in _ROW_ARRAYS:
        value = source.get(key)
        if value is not None:
            layer[key] = mx.contiguous(value[layer.offset : layer.offset + rows])
    layer.exchange = None  # the pipeline's, once cut (``follow_exchange``)
    for key in _SETTINGS:
        if hasattr(source, key):
            setattr(layer, key, getattr(source, key))
    if isinstance(source, nn.QuantizedEmbedding):
        layer.num_embeddings = rows
    if isinstance(source, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        layer.freeze()  # as mlx's quantized layers are


class _VocabEmbedding:
    """The lookup and tied head of an embedding holding rows ``[offset, offset + rows)``; the next class in
    the MRO (``nn.Embedding`` or ``nn.QuantizedEmbedding``) does the arithmetic on them."""

    offset: int
    rows: int
    vocab: int
    tensor: TensorGroup
    exchange: Exchange | None

    def __call__(self, x: mx.array) -> mx.array:
        local = x - self.offset
        inside = (local >= 0) & (local < self.rows)
        found = super().__call__(mx.where(inside, local, 0))  # type: ignore[misc]
        return self.tensor.all_sum(mx.where(inside[..., None], found, mx.zeros((), found.dtype)))

    def as_linear(self, x: mx.array) -> mx.array:
        if not _logits_needed(self):
            return _unread_logits(x, self.vocab)
        return self.tensor.all_gather(super().as_linear(x))  # type: ignore[misc]


class VocabShardedEmbedding(_VocabEmbedding, nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[offset, offset + rows)`` of the vocabulary."""

    def __init__(self, embedding: nn.Embedding, tensor: TensorGroup) -> None:
        _take_rows(self, embedding, tensor)


class VocabShardedQuantizedEmbedding(_VocabEmbedding, nn.QuantizedEmbedding):
    """An ``nn.QuantizedEmbedding`` holding rows ``[offset, offset + rows)`` of the vocabulary: their packed
    weights, scales and biases, with the whole layer's mode, bits and group size."""

    def __init__(self, embedding: nn.QuantizedEmbedding, tensor: TensorGroup) -> None:
        _take_rows(self, embedding, tensor)


class _VocabHead:
    """A head holding its rows of the vocabulary, the logits gathered across the group; the next class in the
    MRO (``nn.Linear`` or ``nn.QuantizedLinear``) computes its rows' logits."""

    vocab: int
    tensor: TensorGroup
    exchange: Exchange | None

    def __call__(self, x: mx.array) -> mx.array:
        if not _logits_needed(self):
            return _unread_logits(x, self.vocab)
        return self.tensor.all_gather(super().__call__(x))  # type: ignore[misc]


class VocabShardedLinear(_VocabHead, nn.Linear):
    """A head ``nn.Linear`` holding its rows of the vocabulary; the logits gathered across the group."""

    def __init__(self, linear: nn.Linear, tensor: TensorGroup) -> None:
        _take_rows(self, linear, tensor)


class VocabShardedQuantizedLinear(_VocabHead, nn.QuantizedLinear):
    """A head ``nn.QuantizedLinear`` holding its rows of the vocabulary (packed weights, scales, biases); the
    logits gathered across the group."""

    def __init__(self, linear: nn.QuantizedLinear, tensor: TensorGroup) -> None:
        _take_rows(self, linear, tensor)


# Each layer's class, by the class it replaces (constructed from the layer and the group).
_SHARDED: dict[type[nn.Module], Callable[[Any, TensorGroup], nn.Module]] = {
    nn.Embedding: VocabShardedEmbedding,
    nn.QuantizedEmbedding: VocabShardedQuantizedEmbedding,
    nn.Linear: VocabShardedLinear,
    nn.QuantizedLinear: VocabShardedQuantizedLinear,
}


def _logits_needed(layer: _VocabEmbedding | _VocabHead) -> bool:
    """Whether this group's logits are read: stage 0's (the one whose member 0 is world rank 0), and every
    stage's in a forward pass that is not the engine's (every rank samples; see the module docstring)."""
    if layer.tensor.first == 0:
        return True
    exchange = layer.exchange
    return exchange is not None and not exchange.explicit and not exchange.probing


def follow_exchange(model: nn.Module, exchange: Exchange | None) -> None:
    """Let the vocabulary-split head of ``model`` see its pipeline's ``Exchange`` (see ``_logits_needed``)."""
    for _, module in model.named_modules():
        if isinstance(module, (_VocabEmbedding, _VocabHead)):
            module.exchange = exchange


def _unread_logits(x: mx.array, vocab: int) -> mx.array:
    """A lazy stand-in of the logits' shape for a stage that never reads them."""
    return mx.broadcast_to(mx.zeros((), x.dtype), (*x.shape[:-1], vocab))


def shard_vocab(model: nn.Module, tensor: TensorGroup) -> list[str]:
    """Split the model's embedding and head by vocabulary, plain or quantized, where divisible; returns what
    was split."""
    n, done = tensor.size(), []
    embedding = _embedding(model)
    vocab: int | None = embedding[1].weight.shape[0] if embedding is not None else None
    if embedding is not None and vocab is not None and vocab % n == 0:
        owner, key, module = _owner_of(model, embedding[1])
        owner[key] = _SHARDED[type(module)](module, tensor)
        done.append(embedding[0])
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _HEAD_NAMES and type(module) in _HEADS and module.weight.shape[0] % n == 0 \
                and (vocab is None or module.weight.shape[0] == vocab):
            owner, key, _ = _owner_of(model, module)
            owner[key] = _SHARDED[type(module)](module, tensor)
            done.append(name)
    return done


def _embedding(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The token embedding: the plain or quantized embedding with the most rows. One without weights is left out:
    a vision tower's position embedding on a stage that does not run the tower (its weights stripped)."""
    found = [(name, m) for name, m in model.named_modules() if type(m) in _EMBEDDINGS and "weight" in m]
    return max(found, key=lambda item: item[1].weight.shape[0], default=None)


def _owner_of(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """The module holding ``target`` and its key there."""
    for _, module in model.named_modules():
        for key, value in module.items():
            if value is target:
                return module, key, target
    raise LookupError("module not found in the model")
