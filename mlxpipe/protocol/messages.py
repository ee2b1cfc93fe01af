"""What the controller sends every rank, through ``mlx.launch``'s standard input (``wire.encode``).

A serving rank (``worker.generation.loop``) takes ``generate`` (one request, its tokens streamed), ``batch``
(``generate --prompts-file``: many requests overlapped) and ``serve`` (``mlxpipe serve``: then ``submit`` and
``cancel`` as requests come and go); a training rank (``worker.training.train``, ``mlxpipe lora``) takes
``resume``, ``step``, ``eval`` and ``save``, each answered by a ``done`` event of every rank; a links job's rank
(``worker.measure.link_probe``, ``mlxpipe doctor --links``) takes ``measure_host``, ``measure_link`` and
``measure_collective``. ``exit`` ends any of them.

A request travels flat, its fields beside the message's ``type`` (``{"type": "generate", "prompt": ...}``).
The batch and serve messages say their concurrency: the controller decides it (``PipelineConfig.concurrency``),
the ranks never guess it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from mlxpipe.errors import UsageError
from mlxpipe.protocol.checks import at_least
from mlxpipe.protocol.message import Message, Registry, Wire, check_tag
from mlxpipe.protocol.request import Request

RequestId = str | int | None  # a request's ``id``: serve's ``req-N``, a prompts file's id or line number
C = TypeVar("C", bound="_Carrying")


@dataclass(frozen=True)
class _Carrying(Message):
    """A message that carries one request, its fields beside the ``type``."""

    request: Request

    def wire_fields(self) -> Wire:
        return self.request.to_wire()

    @classmethod
    def from_wire(cls: type[C], data: Mapping[str, Any]) -> C:
        check_tag(cls, data)
        return cls(Request.from_wire(data))


@dataclass(frozen=True)
class Generate(_Carrying):
    """One request: rank 0 streams its ``token`` events, every rank ends it with ``done``."""

    TAG = "generate"


@dataclass(frozen=True)
class Batch(Message):
    """Many requests overlapped across the stages, ``concurrency`` at a time, up to ``decode_batch`` per decode
    micro-batch: rank 0 emits a ``result`` per request, every rank ends with ``batch_done``."""

    TAG = "batch"
    requests: tuple[Request, ...]
    concurrency: int
    decode_batch: int = 1  # one request per decode micro-batch, as mlx-lm decodes

    def __post_init__(self) -> None:
        if not self.requests:
            raise UsageError("a batch request needs at least one request")
        at_least(self.concurrency, 1, "concurrency")
        at_least(self.decode_batch, 1, "decode_batch")

    def wire_fields(self) -> Wire:
        return {"requests": [r.to_wire() for r in self.requests], "concurrency": self.concurrency,
                "decode_batch": self.decode_batch}

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Batch:
        return cls(**{**values, "requests": tuple(Request.from_wire(r) for r in values["requests"])})


@dataclass(frozen=True)
class Serve(Message):
    """``mlxpipe serve``: the ranks serve the ``submit`` and ``cancel`` messages that follow, until ``exit``;
    every rank says ``serving``, rank 0 streams each request's tokens and its ``finished``."""

    TAG = "serve"
    concurrency: int
    decode_batch: int = 1
    prompt_cache_size: int = 0  # finished requests whose caches are kept for prefix reuse; 0: none
    # The disk tier (worker.caches.disk_cache): each rank's directory on its own host (rank r: prompt_cache_dirs[r]),
    # and the bytes each may keep there, in GB; None or 0: no disk tier.
    prompt_cache_dirs: list[str] | None = None
    prompt_cache_gb: float = 0.0
    # A prefill chunk's tokens while another request decodes (``worker.generation.schedule``); None: no bound.
    prefill_budget: int | None = None

    def __post_init__(self) -> None:
        at_least(self.concurrency, 1, "concurrency")
        at_least(self.decode_batch, 1, "decode_batch")
        if self.prefill_budget is not None:
            at_least(self.prefill_budget, 1, "prefill_budget")
        at_least(self.prompt_cache_size, 0, "prompt_cache_size")
        if not self.prompt_cache_gb >= 0:
            raise UsageError(f"prompt_cache_gb must be 0 or more, got {self.prompt_cache_gb}")


@dataclass(frozen=True)
class Submit(_Carrying):
    """A served request, as token ids (the controller applied the chat template), with every option."""

    TAG = "submit"


@dataclass(frozen=True)
class Cancel(Message):
    """A served request's client is gone or its stop string came: free its slot on every rank."""

    TAG = "cancel"
    id: RequestId


@dataclass(frozen=True)
class Exit(Message):
    """Every rank waits for the others, says ``bye`` and exits."""

    TAG = "exit"


# --- mlxpipe lora: a training rank's messages, each numbered by ``id`` for its ``done`` events ---------------


@dataclass(frozen=True)
class Resume(Message):
    """``--resume-adapter-file``: each rank takes its layers' adapter weights (base64 safetensors)."""

    TAG = "resume"
    id: int
    data: str


@dataclass(frozen=True)
class Step(Message):
    """One optimizer step over ``batch`` (token rows and their ``[start, end]`` loss spans), cut into
    ``micro_batches`` that flow through the stages as ``schedule`` orders them."""

    TAG = "step"
    id: int
    it: int
    batch: list[list[int]]
    lengths: list[list[int]]
    micro_batches: int
    schedule: str  # 1f1b or gpipe (worker.training.train_schedule)


@dataclass(frozen=True)
class Eval(Message):
    """The loss over ``batches`` (forward only): the validation set's at iteration ``it``, or the test set's."""

    TAG = "eval"
    id: int
    it: int | None  # None: the test set, after training
    what: str  # val or test
    batches: list[tuple[list[list[int]], list[list[int]]]]  # (token rows, loss spans) per batch

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Eval:
        return cls(**{**values, "batches": [(rows, spans) for rows, spans in values["batches"]]})


@dataclass(frozen=True)
class Save(Message):
    """Each rank sends its adapter weights (``adapter`` events); the controller writes them at ``it``."""

    TAG = "save"
    id: int
    it: int
    checkpoint: bool  # also kept as the iteration's checkpoint file


TrainMessage = Resume | Step | Eval | Save


# --- mlxpipe doctor --links: a links job's rank (``worker.measure.link_probe``), one measurement at a time ---------


@dataclass(frozen=True)
class MeasureHost(Message):
    """Rank ``rank`` measures its machine (memory bandwidth, matrix throughput; with ``calibrate``, real
    transformer layers too) and says ``host_measured``; the others wait on their standard input, idle. A CPU
    that ``share`` ranks of the job share is measured on its share of the cores, as each of them will run."""

    TAG = "measure_host"
    rank: int
    calibrate: bool = False
    share: int = 1

    def __post_init__(self) -> None:
        at_least(self.share, 1, "share")


@dataclass(frozen=True)
class MeasureLink(Message):
    """Ring neighbours ``a`` and ``b`` time ``rounds`` round trips of a small message, then ``large`` bytes one
    way (the best of 3); ``a`` says ``link_measured``. The others wait, idle."""

    TAG = "measure_link"
    a: int
    b: int
    rounds: int
    large: int

    def __post_init__(self) -> None:
        at_least(self.rounds, 1, "rounds")
        at_least(self.large, 1, "large")


@dataclass(frozen=True)
class MeasureCollective(Message):
    """Every rank: ``rounds`` small all-reduces on the CPU stream (the engine's per-tick collective); rank 0 says
    ``collective_measured``."""

    TAG = "measure_collective"
    rounds: int

    def __post_init__(self) -> None:
        at_least(self.rounds, 1, "rounds")


LinksMessage = MeasureHost | MeasureLink | MeasureCollective

MESSAGES: Registry[Message] = Registry(Generate, Batch, Serve, Submit, Cancel, Exit, Resume, Step, Eval, Save,
                                       MeasureHost, MeasureLink, MeasureCollective)
