"""The caches of the requests on one stage: a request's own, until it joins a decode group, then its
group's batch caches (one of mlx-lm's ``BatchKVCache``, ``BatchRotatingKVCache``... per layer), merged from
its members' own caches as they join and filtered as they leave, as mlx-lm's ``BatchGenerator`` does."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlxpipe.protocol.checks import at_least
from mlxpipe.protocol.job import JobSpec


class MicroBatchView(Protocol):
    """A micro-batch's rows (``generation.schedule.MicroBatch``): one request per row, its decode group if any.

    This and the two views below are what the caches read of the engine's schedule: protocols, so that the
    generation room imports the caches and not the reverse."""

    @property
    def requests(self) -> tuple[int, ...]: ...

    @property
    def group(self) -> int | None: ...

    @property
    def request(self) -> int: ...


class RequestView(Protocol):
    """Where one request stands (``generation.schedule.RequestState``), as far as its caches care."""

    @property
    def batch_key(self) -> Hashable: ...

    @property
    def finish_reason(self) -> str | None: ...


class ScheduleView(Protocol):
    """The requests of a schedule (``generation.schedule.Schedule``), by index."""

    @property
    def requests(self) -> Sequence[RequestView]: ...


def decode_batch_for(model: nn.Module, job: JobSpec, requested: int) -> int:
    """Requests per decode micro-batch for ``model``: ``requested``, or 1 where its caches cannot be batched.

    mlx-lm's own test (its server's ``is_batchable``): every cache has
    ``merge``. Quantized and chunked caches, for two, have none; mlx-lm's server
    then serves one request at a time, and the engine one request per decode
    micro-batch.
    """
    if at_least(requested, 1, "decode_batch") == 1:
        return 1
    caches = make_prompt_cache(model, max_kv_size=job.max_kv_size)
    return requested if all(hasattr(c, "merge") for c in caches) else 1


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Requests' own caches as one batch cache per layer (as ``BatchGenerator`` merges them)."""
    return [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]


class BatchCaches:
    """Every request's caches on this stage, as the engine's micro-batches run with them."""

    def __init__(self, schedule: ScheduleView, decode_batch: int) -> None:
        self.schedule, self.decode_batch = schedule, decode_batch
        self.own: dict[int, list[Any]] = {}  # a request's own caches, until it joins a decode group
        # group -> (its requests in row order, their batch caches) as this stage last ran it
        self.groups: dict[int, tuple[list[int], list[Any]]] = {}

    def for_batch(self, batch: MicroBatchView) -> list[Any]:
        """The caches ``batch`` runs with on this stage: its request's own, or its group's batch caches.

        A group's batch caches follow its members: requests that left are
        filtered out (those that moved to another group take their own caches
        along), requests that joined (at the end of the rows) have their own
        caches merged in, as ``BatchGenerator`` extends its batch.
        """
        if batch.group is None or self.decode_batch == 1 or self.schedule.requests[batch.requests[0]].batch_key is None:
            return self.own[batch.request]  # a prefill chunk, or a request that decodes alone
        wanted = list(batch.requests)
        rows, _ = self.groups.get(batch.group, ([], []))
        for index in rows:
            if index not in wanted and self.schedule.requests[index].finish_reason is None:
                self.own[index] = self.take_own(index)  # it moved to another group
        rows, cache = self.groups.get(batch.group, ([], []))
        keep = [i for i, index in enumerate(rows) if index in wanted]
        if len(keep) < len(rows):
            if keep:
                for c in cache:
                    c.filter(keep)
            else:
                cache = []
        rows = [rows[i] for i in keep]
        if wanted[: len(rows)] != rows:
            raise RuntimeError(f"group {batch.group}: rows {wanted} do not extend {rows}")
        joining = wanted[len(rows) :]
        if joining:
            merged = merge_caches([self.take_own(index) for index in joining])
            if cache:
                for c, new in zip(cache, merged, strict=True):
                    c.extend(new)
            else:
                cache = merged
        self.groups[batch.group] = (wanted, cache)
        return cache

    def take_own(self, index: int) -> list[Any]:
        """A request's own caches: kept apart, or taken out of the batch caches of the group it was in."""
        if index in self.own:
            return self.own.pop(index)
        group = self.group_of(index)
        if group is None:
            raise RuntimeError(f"request {index}: no caches on this stage")
        rows, cache = self.groups[group]
        row = rows.index(index)
        own = [c.extract(row) for c in cache]
        keep = [i for i in range(len(rows)) if i != row]
        for c in cache if keep else ():
            c.filter(keep)
        self.groups[group] = ([rows[i] for i in keep], cache if keep else [])
        return own

    def group_of(self, index: int) -> int | None:
        """The group whose batch caches on this stage hold the request's row, if any."""
        return next((g for g, (rows, _) in self.groups.items() if index in rows), None)
