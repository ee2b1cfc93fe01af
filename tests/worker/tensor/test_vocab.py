"""worker/tensor/vocab.py: the head and the embedding split by vocabulary, exact, plain and quantized, in one process.

Each member is the same layer split for its place in a group of 2; the group's gather and sum are done here
by joining or adding the two members' outputs (the ranks' own exchanges run in ``tests/e2e/test_tensor_parallel.py``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxpipe.worker.tensor.vocab import (
    VocabShardedEmbedding,
    VocabShardedLinear,
    VocabShardedQuantizedEmbedding,
    VocabShardedQuantizedLinear,
    shard_vocab,
)

VOCAB, HIDDEN = 64, 32


class _Member:
    """One member's place in a group of 2 whose collectives the test does itself; ``first``: the world rank of
    its member 0 (0: stage 0, whose logits are read)."""

    def __init__(self, rank: int, first: int = 0) -> None:
        self._rank, self.first = rank, first

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank

    def all_sum(self, x: mx.array) -> mx.array:
        return x

    def all_gather(self, x: mx.array, axis: int = -1) -> mx.array:
        return x


def _head(quantized: bool) -> nn.Module:
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    return nn.QuantizedLinear.from_linear(head, group_size=32, bits=4) if quantized else head


def _embedding(quantized: bool) -> nn.Module:
    embedding = nn.Embedding(VOCAB, HIDDEN)
    return nn.QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=4) if quantized else embedding


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "4-bit"])
def test_the_members_logits_in_member_order_are_the_whole_heads_bit_for_bit(quantized: bool) -> None:
    whole = _head(quantized)
    kind = VocabShardedQuantizedLinear if quantized else VocabShardedLinear
    members = [kind(whole, _Member(r)) for r in (0, 1)]
    assert [(m.offset, m.rows) for m in members] == [(0, VOCAB // 2), (VOCAB // 2, VOCAB // 2)]
    x = mx.random.normal((2, 3, HIDDEN))
    joined = mx.concatenate([m(x) for m in members], axis=-1)
    assert mx.array_equal(joined, whole(x))


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "4-bit"])
def test_the_members_lookups_add_up_to_the_whole_embeddings_and_its_tied_head(quantized: bool) -> None:
    whole = _embedding(quantized)
    kind = VocabShardedQuantizedEmbedding if quantized else VocabShardedEmbedding
    members = [kind(whole, _Member(r)) for r in (0, 1)]
    tokens = mx.array([[0, 31, 32, 63, 5]])  # both halves, and their edges
    looked_up = [m(tokens) for m in members]
    assert mx.array_equal(looked_up[0] + looked_up[1], whole(tokens))
    # A token outside a member's rows is zeros there: one member alone holds it.
    assert not mx.any(looked_up[1][0, :2]).item() and not mx.any(looked_up[0][0, 2:4]).item()
    x = mx.random.normal((1, HIDDEN))
    assert mx.array_equal(mx.concatenate([m.as_linear(x) for m in members], axis=-1), whole.as_linear(x))


def test_a_stage_whose_logits_nobody_reads_computes_none() -> None:
    other_stage = VocabShardedLinear(_head(False), _Member(0, first=2))
    logits = other_stage(mx.ones((1, 4, HIDDEN)))
    assert logits.shape == (1, 4, VOCAB) and not mx.any(logits).item()


class _Tiny(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, HIDDEN)
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, vocab, bias=False)


def test_shard_vocab_splits_the_embedding_and_the_head_where_the_vocabulary_divides() -> None:
    model: Any = _Tiny(VOCAB)
    assert shard_vocab(model, _Member(1)) == ["embed_tokens", "lm_head"]
    assert type(model.embed_tokens) is VocabShardedEmbedding and type(model.lm_head) is VocabShardedLinear
    assert model.lm_head.offset == VOCAB // 2 and model.lm_head.weight.shape == (VOCAB // 2, HIDDEN)
    odd: Any = _Tiny(VOCAB + 1)
    assert shard_vocab(odd, _Member(0)) == []  # 65 rows do not halve: both stay whole
    assert type(odd.embed_tokens) is nn.Embedding and type(odd.lm_head) is nn.Linear


def test_an_embedding_whose_weights_were_stripped_is_not_the_token_embedding() -> None:
    """A vision tower's position embedding on a stage that does not run the tower has no weights left."""
    from mlxpipe.worker.stages.cut import strip_weights

    model: Any = _Tiny(VOCAB)
    model.tower = nn.Embedding(4 * VOCAB, HIDDEN)  # more rows than the vocabulary: it would win if it counted
    strip_weights(model.tower)
    assert shard_vocab(model, _Member(0)) == ["embed_tokens", "lm_head"]
