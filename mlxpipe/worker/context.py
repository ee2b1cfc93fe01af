"""What a rank runs requests with: its loaded layers, its group, its job, its progress reporter."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxpipe.protocol.job import JobSpec
from mlxpipe.worker.load import LoadedModel
from mlxpipe.worker.progress import Progress


@dataclass(frozen=True)
class RankContext:
    """One rank's model and peers, as the request loops (``generation.engine``, ``generation.streamed``) read
    them."""

    loaded: LoadedModel  # this rank's layers, its tokenizer, its draft model if any
    group: mx.distributed.Group  # the job's
    job: JobSpec
    progress: Progress  # the stall watchdog's reports
