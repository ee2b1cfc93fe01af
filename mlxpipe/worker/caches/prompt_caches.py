"""Where a request's caches come from on a rank, and where they go when it ends: the prompt cache's two tiers.

The memory tier is mlx-lm's ``LRUPromptCache`` (``--prompt-cache-size``): the longest cached prefix of a
prompt, the same choice on every rank, since every rank inserts and looks up the same token sequences in the
same order. The disk tier (``disk_cache.DiskCache``, ``--prompt-cache-gb``) is each rank's own folder, which
the ranks do not share: a rank's slice may be missing or bad where its peers' are fine. So before one is used
the ranks agree (two tiny collectives, ``agree``): first on the most tokens every rank can give, then that every
rank loaded them; otherwise it is a miss for all, and no rank computes with a cache its peers lack. The disk
is read only when it gives more than the memory tier.

Both tiers get a request's caches when it ends, with every token fed (its prompt and its reply but the last
token): the next turn of a conversation starts with them. The disk tier writes them on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache

from mlxpipe.protocol.job import JobSpec
from mlxpipe.protocol.request import Request
from mlxpipe.worker.agree import agreed_min, all_agree
from mlxpipe.worker.caches.disk_cache import DiskCache, trim

_MODEL_KEY = "model"  # one model per rank: LRUPromptCache's key


@dataclass(frozen=True)
class Found:
    """A request's caches and how many of its prompt's tokens they hold; ``tier``: where they came from."""

    cache: list[Any]
    tokens: int = 0
    tier: str | None = None  # "memory", "disk", or None: made empty


class PromptCaches:
    """A rank's prompt cache tiers; ``fetch`` and ``keep`` run at the same tick on every rank."""

    def __init__(self, model: nn.Module, job: JobSpec, group: mx.distributed.Group,
                 memory: LRUPromptCache | None = None, disk: DiskCache | None = None, disk_tier: bool = False) -> None:
        """``disk_tier``: the ranks serve with a disk tier (each takes part in its agreements, ``disk`` None on a
        rank that could not open its folder)."""
        self.model, self.job, self.group = model, job, group
        self.memory, self.disk, self.disk_tier = memory, disk, disk_tier or disk is not None

    @property
    def keeps(self) -> bool:
        """Whether a tier keeps a finished request's caches."""
        return self.memory is not None or self.disk is not None

    def fetch(self, prompt: list[int], request: Request, key: list[int] | None = None) -> Found:
        """Caches for ``prompt``: the longest cached prefix either tier holds, else empty ones. ``key``: what the
        memory tier finds it by, when not its tokens (a prompt with images: each image's hash in its place)."""
        found = self._from_memory(key if key is not None else prompt)
        if self.disk_tier and self._fits_disk(request):
            found = self._from_disk(prompt, found)
        if found.tier is not None:
            return found
        return Found(make_prompt_cache(self.model, max_kv_size=request.max_kv_size or self.job.max_kv_size))

    def keep(self, tokens: Sequence[int], cache: list[Any], request: Request, key: Sequence[int] | None = None) -> None:
        """A finished request's caches, holding exactly ``tokens``, into every tier (``key``: as ``fetch``'s)."""
        if self.disk is not None and self._fits_disk(request):
            self.disk.save(tokens, cache)  # first: the memory tier may trim them when a later request reuses them
        if self.memory is not None:
            self.memory.insert_cache(_MODEL_KEY, list(key if key is not None else tokens), cache)

    def close(self) -> None:
        """Let the disk tier's writer finish what is queued."""
        if self.disk is not None:
            self.disk.close()

    def _from_memory(self, prompt: list[int]) -> Found:
        if self.memory is None:
            return Found([])
        cache, rest = self.memory.fetch_nearest_cache(_MODEL_KEY, prompt)
        if cache is not None and not rest:
            # The whole prompt is cached; one token must still be fed for the logits.
            rest = prompt[-1:] if can_trim_prompt_cache(cache) and trim(cache, 1) == 1 else prompt
        if cache is not None and len(rest) < len(prompt):
            return Found(cache, len(prompt) - len(rest), "memory")
        return Found([])

    def _from_disk(self, prompt: list[int], found: Found) -> Found:
        """The disk tier's prefix when every rank has it and it is longer than ``found``'s (see the module
        docstring); else ``found``."""
        mine = self.disk.usable(prompt) if self.disk is not None else 0
        length = agreed_min(self.group, mine)
        if length <= found.tokens:
            return found
        assert self.disk is not None  # a rank without its folder offered 0
        cache = self.disk.load(prompt, length)
        if not all_agree(self.group, cache is not None):
            return found
        assert cache is not None
        return Found(cache, length, "disk")

    def _fits_disk(self, request: Request) -> bool:
        """Whether ``request``'s caches are of the kind the disk tier keeps: the job's (its folder's), not
        quantized, and without images (its files are keyed by tokens alone, and an image is more than its
        placeholder tokens). The same answer on every rank: a request and a job every rank shares."""
        return not request.images and request.kv_bits is None and request.max_kv_size in (None, self.job.max_kv_size)
