"""What the ranks and their supervisors tell the controller, one event per line of their output.

A rank writes its events behind ``wire.EVENT_PREFIX`` (``wire.emit``); its supervisor
(``launch.supervisor``) sends them on as frames with the rank, together with its own
(``started``, ``alive``, ``exited``, ``log``), and the controller's frame reader adds
``lost`` for frames it could not put back (``launch.frames``). ``CONTROL`` is what the
failure tracker reads (``launch.failures``); ``EVENTS`` is a serving run's stream,
``TRAIN_EVENTS`` a training run's (``mlxpipe lora``, whose ``done`` differs), ``LINKS_EVENTS`` a links
job's (``mlxpipe doctor --links``).

Figures of memory are in GB, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxpipe.errors import WireError
from mlxpipe.protocol.message import Event, Registry, Wire
from mlxpipe.protocol.messages import RequestId

# --- the supervisor's, and the frame reader's -------------------------------------------------------------


@dataclass(frozen=True)
class Started(Event):
    """The supervisor runs the rank's worker."""

    TAG = "started"
    rank: int
    pid: int | None = None  # the worker's process id (for the rank's log)
    supervisor: int | None = None  # the supervisor's own


@dataclass(frozen=True)
class Alive(Event):
    """The supervisor's heartbeat, every second: the rank's host still answers."""

    TAG = "alive"
    rank: int


@dataclass(frozen=True)
class Exited(Event):
    """The worker's process ended (``returncode``: its status, negative for a signal)."""

    TAG = "exited"
    rank: int
    returncode: int
    signal: str | None = None  # the signal's name, when one ended it
    stopped: str | None = None  # why the supervisor stopped it ("lease", or the signal it was sent); None: it ended
    finished: bool = False  # it said ``bye`` first


@dataclass(frozen=True)
class Log(Event):
    """A line the worker printed that is no event."""

    TAG = "log"
    rank: int
    text: str
    stream: str = "stdout"  # or stderr


@dataclass(frozen=True)
class Lost(Event):
    """Frames of the rank's output that mlx.launch garbled beyond repair (``launch.frames``)."""

    TAG = "lost"
    rank: int
    frames: int
    critical: bool  # one of them carried an event that mattered (a token, a result)


# --- every rank's -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Error(Event):
    """The rank failed (its worker's exception); the supervisor sends its traceback on as ``log`` lines."""

    TAG = "error"
    rank: int
    type: str  # the exception's class
    message: str
    hint: str | None = None
    host: str | None = None
    traceback: str | None = None
    time: float | None = None  # the rank's clock (time.time())


@dataclass(frozen=True)
class Progress(Event):
    """Where the rank stands, at most every second (``worker.progress``): the stall watchdog's report."""

    TAG = "progress"
    rank: int
    what: str
    step: int  # units of work of the current request: the same on every rank, so a lagging one waits


@dataclass(frozen=True)
class Bye(Event):
    """The rank is done (after ``exit``, every rank together)."""

    TAG = "bye"
    rank: int
    host: str | None = None


@dataclass(frozen=True)
class Loaded(Event):
    """The rank holds its layers (a training rank, its LoRA parameters too)."""

    TAG = "loaded"
    rank: int
    host: str
    layers: list[int]  # [start, end)
    num_layers: int
    mode: str
    peak_memory: float
    load_seconds: float
    trainable: int | None = None  # a training rank's LoRA parameters, and its frozen ones
    frozen: int | None = None


# --- a serving rank's -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Token(Event):
    """A sampled token (rank 0): with its new text (``generate``, ``chat``; ``token`` None when the end leaves
    text), or with its log-probabilities when the request asked (``serve``)."""

    TAG = "token"
    rank: int
    token: int | None
    id: RequestId = None
    text: str | None = None
    logprob: float | None = None
    top: list[list[float]] | None = None  # the most likely tokens, [id, logprob], best first


@dataclass(frozen=True)
class Done(Event):
    """A ``generate`` request ended on this rank; rank 0's carries the figures of its clock."""

    TAG = "done"
    rank: int
    finish_reason: str | None  # stop, length, or error (then ``error`` says why)
    tokens: list[int]
    generation_tokens: int
    peak_memory: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    ttft: float | None = None
    draft_tokens: int | None = None  # --draft-model: generated tokens that were the draft's
    error: str | None = None
    id: RequestId = None


@dataclass(frozen=True)
class Result(Event):
    """One request of a ``batch`` ended (rank 0): its text and figures, times from its admission."""

    TAG = "result"
    rank: int
    index: int  # its place in the batch
    id: RequestId
    tokens: list[int]
    text: str
    prompt_tokens: int
    generation_tokens: int
    finish_reason: str | None
    ttft: float
    latency: float
    generation_tps: float
    slot: int | None = None  # the engine's: the slot it ran in, the ticks it was admitted and finished at
    ticks: list[int | None] | None = None
    draft_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class BatchDone(Event):
    """A ``batch`` ended on this rank: the run's figures (the engine's, ``worker.generation.engine.Engine.run``)."""

    TAG = "batch_done"
    rank: int
    requests: int
    concurrency: int
    generation_tokens: int
    seconds: float
    peak_memory: float
    decode_batch: int  # as the rank ran it (1 where the model's caches cannot be batched)
    ticks: int | None = None
    run_ahead: dict[str, int] | None = None  # one stage: decode steps run ahead, used or taken back
    time: dict[str, float] | None = None  # where the rank's time went (worker.generation.engine.TimeSpent.report)


@dataclass(frozen=True)
class Serving(Event):
    """The rank serves the requests that follow (``serve``)."""

    TAG = "serving"
    rank: int
    concurrency: int
    decode_batch: int
    # The prompt cache's disk tier on this rank: its folder, or why it has none (the others then never hit).
    prompt_cache_dir: str | None = None
    prompt_cache_error: str | None = None


@dataclass(frozen=True)
class Finished(Event):
    """A served request ended (rank 0); the controller made its text from its tokens."""

    TAG = "finished"
    rank: int
    id: RequestId
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    error: str | None = None
    cache_tier: str | None = None  # where its cached tokens came from: "memory" or "disk" (None: none were)


@dataclass(frozen=True)
class Time(Event):
    """Serving: where the rank's time has gone (``worker.generation.engine.TimeSpent``) and its memory, as a request
    ends."""

    TAG = "time"
    rank: int
    memory: float  # in use
    peak_memory: float
    compute: float
    send: float
    recv: float
    sync: float
    idle: float
    wall: float
    busy: float  # compute over the time with work in the pipeline
    disk_cache: dict[str, float] | None = None  # the prompt cache's disk tier here (worker.caches.disk_cache.figures)
    vision: float = 0.0  # of compute: the vision tower on prompts' images (the first stage)

    def spent(self) -> dict[str, float]:
        """The time figures alone (``TimeSpent.report``'s)."""
        return {"compute": self.compute, "send": self.send, "recv": self.recv, "sync": self.sync, "idle": self.idle,
                "wall": self.wall, "busy": self.busy, "vision": self.vision}


# --- a training rank's ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainDone(Event):
    """A training message (``kind``: resume, step, eval, save) ended on this rank. What it found comes with it:
    a step's loss (rank 0), an evaluation's summed loss (rank 0), the tensors saved or loaded."""

    TAG = "done"
    id: int
    kind: str
    rank: int
    seconds: float
    peak_memory: float
    host: str | None = None
    it: int | None = None  # step
    compute_seconds: float | None = None  # step: this stage's own work, not its waits
    loss: float | None = None  # step, rank 0
    ntoks: int | None = None  # step and eval, rank 0
    learning_rate: float | None = None  # step, rank 0
    loss_sum: float | None = None  # eval, rank 0
    tensors: int | None = None  # save
    loaded: int | None = None  # resume


@dataclass(frozen=True)
class Adapter(Event):
    """A rank's adapter weights (``save``), as base64 safetensors; empty when it has none."""

    TAG = "adapter"
    id: int
    rank: int
    data: str


# --- a links job's rank (``worker.measure.link_probe``: ``mlxpipe doctor --links``) -----------------------------


@dataclass(frozen=True)
class Joined(Event):
    """The rank joined the job's group: it takes measurements now."""

    TAG = "joined"
    rank: int
    host: str


@dataclass(frozen=True)
class HostMeasured(Event):
    """A machine, measured by one of its ranks (``measure_host``). Rates in bytes/s and FLOP/s."""

    TAG = "host_measured"
    rank: int
    host: str
    chip: str  # the CPU's brand string: "Apple M2 Ultra", or a Linux CPU's model name
    performance_cores: int | None  # a Mac's performance cores (tells apart the binned chips of one name)
    device: str  # where MLX computes: gpu or cpu
    memory_bandwidth: float  # a large array read once
    compute: float  # a large matrix product, in ``dtype``
    dtype: str
    calibration: dict[str, float] | None = None  # with calibrate: plan.cluster_facts.Calibration's fields


@dataclass(frozen=True)
class LinkMeasured(Event):
    """Ranks ``rank`` and ``peer`` measured (``measure_link``): ``latency`` is half the median round trip of a small
    message, ``bandwidth`` the best of 3 one-way transfers of ``large`` bytes (its latency taken off)."""

    TAG = "link_measured"
    rank: int
    peer: int
    latency: float
    bandwidth: float
    rounds: int
    large: int
    round_trips: list[float]  # the 10th, 50th and 90th percentiles, seconds


@dataclass(frozen=True)
class CollectiveMeasured(Event):
    """The median of ``rounds`` small all-reduces over every rank (``measure_collective``)."""

    TAG = "collective_measured"
    rank: int
    seconds: float
    rounds: int


CONTROL: Registry[Event] = Registry(Started, Alive, Exited, Log, Lost, Error, Progress, Bye)
EVENTS: Registry[Event] = CONTROL.extended(Loaded, Token, Done, Result, BatchDone, Serving, Finished, Time)
TRAIN_EVENTS: Registry[Event] = CONTROL.extended(Loaded, TrainDone, Adapter)
LINKS_EVENTS: Registry[Event] = CONTROL.extended(Joined, HostMeasured, LinkMeasured, CollectiveMeasured)


def rank_of(data: Wire) -> int:
    """The rank an event came from: every event a supervisor sends on carries it (``launch.supervisor``)."""
    rank = data["rank"] if "rank" in data else None  # noqa: SIM401 - no .get( on the wire: one grep finds them
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise WireError(f"an event names no rank: {str(data)[:80]}")
    return rank
