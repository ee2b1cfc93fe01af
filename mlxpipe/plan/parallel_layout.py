"""A layout: how one model runs over a hostfile's hosts; a workload: what it is asked to do.

Pure values. ``plan/estimate.py`` predicts what a layout does under a workload from the
cluster's facts; ``plan/choose.py`` lists the feasible layouts and picks one (``--layout auto``).

A layout today is one pipeline: the first ``hosts`` hosts of the hostfile in groups of ``tp``
consecutive hosts, each group a stage (stage 0 runs the last layers and the head, as rank 0 does),
``split`` layers per stage in rank order. The next layout to weigh is replicas (several such
pipelines of one model behind one endpoint): a ``replicas`` count here, the estimate's aggregate
figure multiplied, each replica's hosts taken in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxpipe.defaults import DEFAULT_DECODE_BATCH
from mlxpipe.errors import UsageError

LAYOUTS = ("auto", "pipeline")  # --layout: the cost model chooses, or the pipeline of --strategy
WORKLOADS = ("chat", "agent", "batch")


@dataclass(frozen=True)
class Layout:
    """One pipeline of ``hosts // tp`` stages over the hostfile's first ``hosts`` hosts (see the module)."""

    tp: int
    split: tuple[int, ...]  # layers per stage, rank order (stage 0: the last layers)
    strategy: str  # how ``split`` was chosen: even, memory, balanced, split (given)
    hosts: int  # the hostfile's first this many hosts

    def __post_init__(self) -> None:
        if self.tp < 1 or self.hosts < 1 or self.hosts % self.tp or len(self.split) != self.hosts // self.tp:
            raise ValueError(f"a layout of {self.hosts} hosts in groups of {self.tp} cannot have split {self.split}")

    @property
    def stages(self) -> int:
        return self.hosts // self.tp

    @property
    def name(self) -> str:
        """``pipeline balanced 6,6``, ``tp 2``, ``tp 2 x 2 stages even 6,6``; a single host: ``1 host``."""
        split = ",".join(map(str, self.split))
        if self.hosts == 1:
            return "1 host"
        if self.tp == 1:
            return f"pipeline {self.strategy} {split}"
        if self.stages == 1:
            return f"tp {self.tp}"
        return f"tp {self.tp} x {self.stages} stages {self.strategy} {split}"

    @property
    def flags(self) -> str:
        """The command-line flags that run it (``--tp 2 --split 6,6``), given the same hostfile."""
        parts = [f"--tp {self.tp}"] if self.tp > 1 else []
        if self.stages > 1:
            parts.append(f"--split {','.join(map(str, self.split))}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What a layout is judged on: a request's prompt and reply, and how many run at once.

    ``score`` is the seconds one request takes: its prompt at the layout's prefill rate, its reply at
    the single-stream decode rate, or, under ``batch``, at the aggregate rate of ``concurrency``
    requests sharing the layout.
    """

    name: str
    prompt: int  # tokens
    generated: int  # tokens
    concurrent: bool  # many requests at once: judged by aggregate throughput

    @staticmethod
    def concurrency(hosts: int) -> int:
        """Requests in flight for the aggregate figure, the same for every layout of ``hosts`` hosts: as many as the
        longest pipeline keeps busy (a decode group per stage)."""
        return hosts * DEFAULT_DECODE_BATCH

    @property
    def describes(self) -> str:
        """``a chat turn (1,000-token prompt, 250 tokens out)``."""
        names = {"chat": "a chat turn", "agent": "an agent step", "batch": "a batched request"}
        what = names.get(self.name, "a request")
        return f"{what} ({self.prompt:,}-token prompt, {self.generated:,} tokens out)"


# The prompt and reply of each workload: a chat turn, an agent's step (its whole context again: tool
# outputs and files make prompts long), and a batch of chat-sized requests judged by throughput.
CHAT = Workload("chat", prompt=1000, generated=250, concurrent=False)
AGENT = Workload("agent", prompt=8000, generated=250, concurrent=False)
BATCH = Workload("batch", prompt=1000, generated=250, concurrent=True)
DEFAULT_WORKLOAD = CHAT


def workload(name: str | None, flag: str = "--workload") -> Workload:
    """The workload named ``name`` (None: chat)."""
    if name is None:
        return DEFAULT_WORKLOAD
    found = {w.name: w for w in (CHAT, AGENT, BATCH)}.get(name)
    if found is None:
        raise UsageError(f"{flag} {name!r}: use one of {', '.join(WORKLOADS)}")
    return found
