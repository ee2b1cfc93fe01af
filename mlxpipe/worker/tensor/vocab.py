"""The vocabulary head and the embedding, split by vocabulary across a tensor group.

mlx-lm's ``shard()`` leaves both whole on every member; the head is one of the
largest matrices a token goes through. Both splits are exact:

* the head: each member computes the logits of its rows of the vocabulary and
  the group gathers them in member order (no sum is reordered);
* the embedding: each member looks up the tokens in its rows, zeros for the
  others, and the group adds them up: one member alone is non-zero, and adding
  zeros is exact. A tied head (``embed_tokens.as_linear``) uses the same rows.

A vocabulary that does not divide by the group's size stays whole. In a
pipeline only stage 0 needs the logits: the head of another stage computes
nothing (its group's exchanges run as they are built, whether or not their
result is used, see ``worker.groups``) and gives zeros of the logits' shape,
which nothing reads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.worker.groups import TensorGroup

_HEAD_NAMES = ("lm_head", "output", "head")


class VocabShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[offset, offset + rows)`` of the vocabulary."""

    def __init__(self, embedding: nn.Embedding, tensor: TensorGroup) -> None:
        nn.Module.__init__(self)
        rows = embedding.weight.shape[0] // tensor.size()
        self.offset, self.rows, self.tensor = tensor.rank() * rows, rows, tensor
        self.vocab = embedding.weight.shape[0]
        self.weight = mx.contiguous(embedding.weight[self.offset : self.offset + rows])

    def __call__(self, x: mx.array) -> mx.array:
        local = x - self.offset
        inside = (local >= 0) & (local < self.rows)
        found = self.weight[mx.where(inside, local, 0)]
        return self.tensor.all_sum(mx.where(inside[..., None], found, mx.zeros((), found.dtype)))

    def as_linear(self, x: mx.array) -> mx.array:
        if not _logits_needed(self.tensor):
            return _unread_logits(x, self.vocab)
        return self.tensor.all_gather(x @ self.weight.T)


class VocabShardedLinear(nn.Linear):
    """A head ``nn.Linear`` holding its rows of the vocabulary; the logits gathered across the group."""

    def __init__(self, linear: nn.Linear, tensor: TensorGroup) -> None:
        nn.Module.__init__(self)
        rows = linear.weight.shape[0] // tensor.size()
        start = tensor.rank() * rows
        self.tensor, self.vocab = tensor, linear.weight.shape[0]
        self.weight = mx.contiguous(linear.weight[start : start + rows])
        if "bias" in linear:
            self.bias = mx.contiguous(linear.bias[start : start + rows])

    def __call__(self, x: mx.array) -> mx.array:
        if not _logits_needed(self.tensor):
            return _unread_logits(x, self.vocab)
        logits = mx.addmm(self["bias"], x, self["weight"].T) if "bias" in self else x @ self["weight"].T
        return self.tensor.all_gather(logits)


def _logits_needed(tensor: TensorGroup) -> bool:
    """Whether this group's logits are read: stage 0's (the one whose member 0 is world rank 0)."""
    return tensor.first == 0


def _unread_logits(x: mx.array, vocab: int) -> mx.array:
    """A lazy stand-in of the logits' shape for a stage that never reads them."""
    return mx.broadcast_to(mx.zeros((), x.dtype), (*x.shape[:-1], vocab))


def shard_vocab(model: nn.Module, tensor: TensorGroup) -> list[str]:
    """Split the model's embedding and head by vocabulary, where plain and divisible; returns what was split."""
    n, done = tensor.size(), []
    embedding = _embedding(model)
    vocab = embedding[1].weight.shape[0] if embedding is not None else None
    if embedding is not None and vocab % n == 0:
        owner, key, module = _owner_of(model, embedding[1])
        owner[key] = VocabShardedEmbedding(module, tensor)
        done.append(embedding[0])
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _HEAD_NAMES and type(module) is nn.Linear and module.weight.shape[0] % n == 0 \
                and (vocab is None or module.weight.shape[0] == vocab):
            owner, key, _ = _owner_of(model, module)
            owner[key] = VocabShardedLinear(module, tensor)
            done.append(name)
    return done


def _embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The token embedding: the plain ``nn.Embedding`` with the most rows."""
    found = [(name, m) for name, m in model.named_modules() if type(m) is nn.Embedding]
    return max(found, key=lambda item: item[1].weight.shape[0], default=None)


def _owner_of(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """The module holding ``target`` and its key there."""
    for _, module in model.named_modules():
        for key, value in module.items():
            if value is target:
                return module, key, target
    raise LookupError("module not found in the model")
