"""The training data, batched exactly as mlx_lm.lora batches it (``iterate_batches`` with the same seed and the
same draws in the same order), and every message of a run in mlx_lm.lora's order of events."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mlxpipe.errors import UsageError
from mlxpipe.lora.options import TrainOptions
from mlxpipe.protocol.messages import Eval, Resume, Save, Step, TrainMessage

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass
class Datasets:
    train: Any
    valid: Any
    test: Any


def load_datasets(options: TrainOptions, model_dir: Path) -> Datasets:
    """mlx-lm's ``load_dataset`` with the model's tokenizer, wrapped as mlx_lm.lora wraps them."""
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir, {"trust_remote_code": options.trust_remote_code})
    try:
        train, valid, test = load_dataset(options.mlx_lm_args(), tokenizer)
    except ValueError as e:
        raise UsageError(f"--data {options.data}: {e}") from e
    return Datasets(CacheDataset(train), CacheDataset(valid), CacheDataset(test))


def longest_sequence(dataset: Any) -> int:
    """The longest tokenized sequence of ``dataset`` (mlx-lm caches the tokenization for the batches)."""
    longest = 0
    for i in range(len(dataset)):
        item = dataset[i]
        tokens = item[0] if isinstance(item, tuple) else item
        longest = max(longest, len(tokens))
    return longest


def _wire(batch: tuple[mx.array, mx.array]) -> tuple[list[list[int]], list[list[int]]]:
    tokens, lengths = batch
    return cast(list[list[int]], tokens.tolist()), cast(list[list[int]], lengths.tolist())


def eval_batches(
    dataset: Any, options: TrainOptions, num_batches: int
) -> list[tuple[list[list[int]], list[list[int]]]]:
    """The batches mlx-lm's ``evaluate`` takes, drawn the same way (one permutation, when any batch is taken)."""
    from mlx_lm.tuner.trainer import iterate_batches

    index = iter(range(num_batches)) if num_batches != -1 else iter(int, 1)
    batches = iterate_batches(dataset=dataset, batch_size=options.batch_size, max_seq_length=options.max_seq_length)
    return [_wire(b) for _, b in zip(index, batches, strict=False)]


def requests(options: TrainOptions, data: Datasets, resume: bytes | None) -> Iterator[TrainMessage]:
    """Every message of the run, numbered, in mlx_lm.lora's order of events (so numpy's draws come in the same
    order)."""
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    ids = itertools.count(1)
    np.random.seed(options.seed)
    if resume is not None:
        yield Resume(id=next(ids), data=base64.b64encode(resume).decode())
    if options.train:
        train = iterate_batches(dataset=data.train, batch_size=options.batch_size,
                                max_seq_length=options.max_seq_length, loop=True)
        for it, batch in zip(range(1, options.iters + 1), train, strict=False):
            if len(data.valid) and (it == 1 or it % options.steps_per_eval == 0 or it == options.iters):
                yield Eval(id=next(ids), it=it, what="val",
                           batches=eval_batches(data.valid, options, options.val_batches))
            tokens, lengths = _wire(batch)
            yield Step(id=next(ids), it=it, batch=tokens, lengths=lengths, micro_batches=options.micro_batches,
                       schedule=options.schedule)
            if it % options.save_every == 0:
                yield Save(id=next(ids), it=it, checkpoint=True)
        yield Save(id=next(ids), it=options.iters, checkpoint=False)
    if options.test:
        yield Eval(id=next(ids), it=None, what="test", batches=eval_batches(data.test, options, options.test_batches))
