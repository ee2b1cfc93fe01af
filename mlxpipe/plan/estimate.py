"""The cost model: what a layout is predicted to do, from the model's bytes and FLOPs and the cluster's facts.

Pure: the model's work per layer (``plan/model_work.py``), the hosts' and links' measured figures
(``plan/cluster_facts.py``) and a ``Layout``; no MLX, no network. Every figure is checkable: ``plan``
shows them, ``bench/bench_layout.py`` measures them, docs/layout.md gives the formulas.

A rank's time on one micro-batch of ``b`` tokens (a decode step) or one prompt chunk of ``m``
tokens, on its host (``Machine``: the calibrated figures, else the published bandwidth and the
measured matmul throughput, each at an assumed efficiency):

* a layer costs ``max(bytes / bandwidth, flops / compute) + layer_overhead``: its weights are read
  once per micro-batch (routed experts at the share a token uses), its FLOPs are 2 per weight per
  token plus attention over the context; the KV cache it reads counts as bytes;
* stage 0 also runs the vocabulary head: every decode step, and once per prompt (its last token);
* under ``--tp T`` each member does 1/T of its stage's layers and head, and every layer adds two
  all-reduces of the hidden state (``allreduce``: 2 members swap once; more members pass it down
  their chain and back), the head one gather of the logits.

The engine (``worker/generation/engine.py``) runs in lockstep ticks: at each tick every stage runs its micro-batch,
sends its hidden state to the next stage (``hop``: the link's latency plus bytes over its bandwidth,
down the chain of the next group's members), and every rank takes part in one small collective
(rank 0's tokens: the measured all-reduce of the whole world) plus its engine's own overhead. So:

* single-stream decode: a token crosses every stage, one tick each:
  ``sum(stage steps) + sum(hops) + stages * (collective + step_overhead)``;
* prefill of ``P`` tokens: the first ``P - 1`` in chunks of ``prefill_step`` that follow each other
  through the stages, one tick each, each tick as long as its slowest stage; then the last token as a
  decode step (it samples);
* aggregate decode of ``C`` requests in groups of ``decode_batch``: at each tick one group leaves
  stage 0 when there are at least as many groups as stages, else only that share of the ticks yields
  tokens.

A lone host runs mlx-lm's own generation: no ticks, no collective, one prompt chunk of 2048.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

from mlxpipe.defaults import DEFAULT_DECODE_BATCH, MLX_LM_PREFILL_STEP, PIPELINE_PREFILL_STEP
from mlxpipe.plan.cluster_facts import ClusterFacts, HostFacts
from mlxpipe.plan.model_work import ModelWork
from mlxpipe.plan.parallel_layout import Layout, Workload
from mlxpipe.plan.splits import PhaseCosts

# Uncalibrated hosts: the share of the published memory bandwidth a decode step reaches, and of the
# measured matmul throughput a prompt chunk reaches. Assumed, not measured: `doctor --links --calibrate`
# measures them (docs/layout.md says how to check a prediction).
DECODE_EFFICIENCY = 0.75
PREFILL_EFFICIENCY = 0.6
# Without facts, every host is this one: what the cost model needs is the ratio of compute to bandwidth
# (an Apple M2 Max's 400 GB/s and ~13.6 TFLOP/s of fp16), which decides how a batch weighs prefill against decode.
NOMINAL_BANDWIDTH = 400e9
NOMINAL_COMPUTE = 13.6e12
# Without a measured link: a TCP hop over Thunderbolt or 10 Gb Ethernet (ring), an RDMA one (JACCL).
NOMINAL_LATENCY = {"ring": 50e-6, "mpi": 50e-6, "jaccl": 10e-6, "jaccl-ring": 10e-6, "nccl": 10e-6}
NOMINAL_LINK_BANDWIDTH = 1e9
LOGITS_BYTES = 4  # the head's logits are gathered in float32

# --- one host ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """The figures the cost model computes with on one host (``machine``)."""

    bandwidth: float  # bytes/s a decode step reads weights at
    compute: float  # FLOP/s a prompt chunk computes at
    layer_overhead: float = 0.0  # seconds per layer per forward pass
    step_overhead: float = 0.0  # seconds per engine tick

    def layer(self, nbytes: float, flops: float) -> float:
        """One layer's forward pass: bound by reading its bytes or by its arithmetic, whichever is slower."""
        return max(nbytes / self.bandwidth, flops / self.compute) + self.layer_overhead


NOMINAL = Machine(NOMINAL_BANDWIDTH * DECODE_EFFICIENCY, NOMINAL_COMPUTE * PREFILL_EFFICIENCY)


def machine(host: HostFacts | None) -> Machine:
    """A host's calibrated figures, else its published bandwidth and measured compute at the assumed
    efficiencies; without facts, the nominal host."""
    if host is None:
        return NOMINAL
    c = host.calibration
    if c is not None:
        return Machine(c.decode_bandwidth, c.prefill_flops, c.layer_overhead, c.step_overhead)
    return Machine(host.memory_bandwidth * DECODE_EFFICIENCY, host.compute * PREFILL_EFFICIENCY)


# --- the network ------------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """The links a layout's ranks use: each neighbour pair's (latency, bandwidth), the world's collective."""

    links: dict[tuple[int, int], tuple[float, float]]
    collective: float  # seconds of the per-tick all-reduce of the layout's ranks

    def link(self, a: int, b: int) -> tuple[float, float]:
        return self.links[(min(a, b), max(a, b))]

    def transfer(self, a: int, b: int, nbytes: float) -> float:
        latency, bandwidth = self.link(a, b)
        return latency + nbytes / bandwidth


def network(facts: ClusterFacts | None, hosts: int, backend: str) -> Network:
    """The links between the first ``hosts`` ranks (neighbours, and the last to the first: the ring), as
    measured; the per-tick collective as measured when the layout uses every measured host, else the
    ring all-reduce of its ranks modelled from their links (``2 (n - 1)`` steps of the slowest)."""
    nominal = (NOMINAL_LATENCY.get(backend, NOMINAL_LATENCY["ring"]), NOMINAL_LINK_BANDWIDTH)
    links: dict[tuple[int, int], tuple[float, float]] = {}
    for a in range(hosts):
        for b in (a + 1, 0):
            if b == a or b >= hosts:
                continue
            measured = facts.link(a, b) if facts is not None else None
            if measured is None and facts is not None and b == 0:
                # The first ``hosts`` ranks' ring closes over a pair the hostfile's ring never uses: its slowest link.
                measured = max(facts.links, key=lambda link: link.latency, default=None)
            links[(min(a, b), max(a, b))] = (measured.latency, measured.bandwidth) if measured else nominal
    if hosts == 1:
        collective = 0.0
    elif facts is not None and facts.collective is not None and hosts == facts.size:
        collective = facts.collective
    else:
        collective = 2 * (hosts - 1) * max(latency for latency, _ in links.values())
    return Network(links, collective)


# --- what one stage costs ---------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of a layout: its layers, its group's ranks and their machines."""

    index: int  # 0 runs the last layers and the head
    start: int
    end: int
    ranks: tuple[int, ...]
    machines: tuple[Machine, ...]

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def has_head(self) -> bool:
        return self.index == 0


def stages(layout: Layout, facts: ClusterFacts | None) -> list[Stage]:
    """The layout's stages, in stage order (stage 0: the last layers)."""
    bounds = [(sum(layout.split[g + 1:]), sum(layout.split[g:])) for g in range(layout.stages)]
    return [_stage(g, start, end, layout.tp, facts) for g, (start, end) in enumerate(bounds)]


def _stage(g: int, start: int, end: int, tp: int, facts: ClusterFacts | None) -> Stage:
    ranks = tuple(range(g * tp, (g + 1) * tp))
    hosts = [facts.host(r) if facts is not None and r < facts.size else None for r in ranks]
    return Stage(g, start, end, ranks, tuple(machine(h) for h in hosts))


def allreduce(stage: Stage, net: Network, nbytes: float, whole_world: bool) -> float:
    """One all-reduce of ``nbytes`` over the stage's group (``worker/groups.py``): 2 members swap, member 0 sending
    its part once member 1's arrived (so that neither waits on a full socket), so a swap is a round trip; more
    pass partial sums down their chain and the total back up; a group that is the whole world uses MLX's ring
    all_sum (2 (T - 1) steps, every member sending a T-th of the data at once)."""
    r = stage.ranks
    if len(r) == 1:
        return 0.0
    if len(r) == 2:
        return 2 * net.transfer(r[0], r[1], nbytes)
    if whole_world:
        return 2 * (len(r) - 1) * max(net.transfer(a, b, nbytes / len(r)) for a, b in pairwise(r))
    return 2 * sum(net.transfer(a, b, nbytes) for a, b in pairwise(r))


def layer_times(work: ModelWork, stage: Stage, machine_: Machine, rows: int, context: float,
                net: Network, whole_world: bool, caches: int | None = None) -> list[float]:
    """Seconds each of the stage's layers takes one member for ``rows`` tokens attending to ``context`` tokens
    each, reading ``caches`` KV caches (a decode step: ``rows`` requests, a cache each; a prompt chunk: its
    tokens, ``context`` their mean context, one cache read once), its group's two all-reduces included."""
    t = stage.tp
    kv_share = t if work.kv_splits else 1
    caches = rows if caches is None else caches
    reduce = 2 * allreduce(stage, net, work.hidden_bytes(rows), whole_world) if t > 1 else 0.0
    out = []
    for i in range(stage.start, stage.end):
        per, window = work.kv[i]
        seen = min(context, window) if window else context
        nbytes = work.layer_bytes[i] / t + caches * per * seen / kv_share
        flops = rows * (work.layer_flops[i] + work.attention_flops[i] * seen) / t
        out.append(machine_.layer(nbytes, flops) + reduce)
    return out


def head_time(work: ModelWork, stage: Stage, machine_: Machine, rows: int, net: Network, whole_world: bool) -> float:
    """The vocabulary head on ``rows`` tokens, on one member of stage 0 (1/T of it, then the logits gathered)."""
    t = stage.tp
    seconds = machine_.layer(work.head_bytes / t, rows * work.head_flops / t) - machine_.layer_overhead
    if t > 1:
        seconds += allreduce(stage, net, rows * work.vocab * LOGITS_BYTES / t, whole_world)
    return seconds


def step_time(work: ModelWork, stage: Stage, net: Network, rows: int, context: float, whole_world: bool,
              head: bool = True, caches: int | None = None) -> float:
    """A stage's forward pass over ``rows`` tokens (``caches``: see ``layer_times``): its slowest member's
    layers, and stage 0's head."""
    return max(sum(layer_times(work, stage, m, rows, context, net, whole_world, caches))
               + (head_time(work, stage, m, rows if head else 0, net, whole_world) if stage.has_head and head else 0.0)
               for m in stage.machines)


def hop_time(work: ModelWork, stage: Stage, net: Network, rows: int) -> float:
    """The hidden state of ``rows`` tokens from ``stage`` to the next one (stage - 1): from its member 0 to
    the next stage's last member, then down that group's chain to its member 0."""
    if stage.index == 0:
        return 0.0
    nbytes = work.hidden_bytes(rows)
    first = stage.ranks[0]
    chain = list(range(first - 1, first - 1 - stage.tp, -1))  # the next stage's members, last to first
    return net.transfer(first, chain[0], nbytes) + sum(net.transfer(a, b, nbytes) for a, b in pairwise(chain))


# --- what a layout does -----------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """What a layout is predicted to do under a workload."""

    layout: Layout
    decode: float  # single-stream decode, tokens/s
    prefill: float  # prefill of a ``prompt``-token prompt, tokens/s
    aggregate: float  # decode of ``concurrency`` requests together, tokens/s
    prompt: int
    concurrency: int
    score: float  # seconds one request of the workload takes (lower is better)
    # Where a single-stream token's time goes, in seconds: the stages' compute, the links, the engine.
    parts: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"layout": self.layout.name, "flags": self.layout.flags, "tp": self.layout.tp,
                "split": list(self.layout.split), "strategy": self.layout.strategy, "hosts": self.layout.hosts,
                "decode_tps": self.decode, "prefill_tps": self.prefill, "aggregate_tps": self.aggregate,
                "prompt": self.prompt, "concurrency": self.concurrency, "seconds_per_request": self.score,
                "parts": dict(self.parts)}


@dataclass(frozen=True)
class Costing:
    """Everything the estimates of one model on one cluster share."""

    work: ModelWork
    facts: ClusterFacts | None
    backend: str = "ring"
    decode_batch: int = DEFAULT_DECODE_BATCH


def estimate(costing: Costing, layout: Layout, workload: Workload, *, prompt: int | None = None,
             concurrency: int | None = None) -> Estimate:
    """The three figures of ``layout`` and its workload score (``prompt`` / ``concurrency``: other than the
    workload's)."""
    prompt = prompt or workload.prompt
    concurrency = concurrency or workload.concurrency(costing.facts.size if costing.facts else layout.hosts)
    context = prompt + workload.generated / 2
    token, parts = decode_token(costing, layout, context)
    prefill = prompt / prefill_seconds(costing, layout, prompt)
    aggregate = aggregate_rate(costing, layout, concurrency, context)
    reply = workload.generated / (aggregate if workload.concurrent else 1 / token)
    return Estimate(layout, 1 / token, prefill, aggregate, prompt, concurrency,
                    score=prompt / prefill + reply, parts=parts)


def _setup(costing: Costing, layout: Layout) -> tuple[list[Stage], Network, bool]:
    net = network(costing.facts, layout.hosts, costing.backend)
    return stages(layout, costing.facts), net, layout.stages == 1


def _tick(st: list[Stage], net: Network) -> float:
    """What every tick costs beyond the stages' work: the collective and the engine's own overhead."""
    return net.collective + max(m.step_overhead for s in st for m in s.machines)


def decode_token(costing: Costing, layout: Layout, context: float) -> tuple[float, dict[str, float]]:
    """Seconds per token of one stream, and where they go (compute, links, engine)."""
    st, net, world = _setup(costing, layout)
    work = costing.work
    compute = sum(step_time(work, s, net, 1, context, world) for s in st)
    hops = sum(hop_time(work, s, net, 1) for s in st)
    if layout.hosts == 1:
        return compute, {"compute": compute}
    ticks = len(st) * _tick(st, net)
    reduce = sum(step_time(work, s, net, 1, context, world) - _no_links(work, s, 1, context) for s in st)
    return compute + hops + ticks, {"compute": compute - reduce, "links": hops + reduce + len(st) * net.collective,
                                    "engine": ticks - len(st) * net.collective}


def _no_links(work: ModelWork, stage: Stage, rows: int, context: float) -> float:
    """``step_time`` with free links: what of a stage's step is its own compute."""
    free = Network({(a, b): (0.0, math.inf) for a in stage.ranks for b in stage.ranks if a < b}, 0.0)
    return step_time(work, stage, free, rows, context, False)


def prefill_seconds(costing: Costing, layout: Layout, prompt: int) -> float:
    """Seconds from a ``prompt``-token prompt to its first token (see the module docstring)."""
    st, net, world = _setup(costing, layout)
    work = costing.work
    step = MLX_LM_PREFILL_STEP if layout.hosts == 1 else PIPELINE_PREFILL_STEP
    chunks = chunk_sizes(prompt - 1, step)
    first = len(st) - 1  # prompts enter at the highest stage (the first layers)
    tick = 0.0 if layout.hosts == 1 else _tick(st, net)
    total = 0.0
    offsets = [sum(chunks[:c]) for c in range(len(chunks))]
    for t in range(len(chunks) + first):
        slowest = 0.0
        for s in st:
            c = t - (first - s.index)
            if 0 <= c < len(chunks):
                mean_context = offsets[c] + chunks[c] / 2
                busy = step_time(work, s, net, chunks[c], mean_context, world, head=False, caches=1)
                slowest = max(slowest, busy + hop_time(work, s, net, chunks[c]))
        total += slowest + tick
    token, _ = decode_token(costing, layout, prompt)
    return total + token


def chunk_sizes(tokens: int, step: int) -> list[int]:
    """A prompt's prefill chunks (all but its last token, in ``step``-token chunks)."""
    full, rest = divmod(max(tokens, 0), step)
    return [step] * full + ([rest] if rest else [])


def aggregate_rate(costing: Costing, layout: Layout, concurrency: int, context: float) -> float:
    """Tokens/s of ``concurrency`` requests decoding together, in groups of ``decode_batch`` (one per tick)."""
    st, net, world = _setup(costing, layout)
    work = costing.work
    groups = math.ceil(concurrency / costing.decode_batch)
    rows = concurrency / groups
    r = math.ceil(rows)
    tick = max(step_time(work, s, net, r, context, world) + hop_time(work, s, net, r) for s in st) + _tick(st, net)
    busy_share = min(groups, len(st)) / len(st)
    return busy_share * rows / tick


# --- what the balanced split weighs --------------------------------------------------------


def phase_costs(costing: Costing, tp: int, stage_count: int, workload: Workload) -> PhaseCosts:
    """Each layer's seconds per prompt token and per generated token on each stage's hosts (its slowest
    member), the head's on stage 0: what ``splits.phase_split`` balances for ``workload``."""
    work, n = costing.work, costing.work.num_layers
    hosts = tp * stage_count
    net = network(costing.facts, hosts, costing.backend)
    whole = stage_count == 1
    chunk = max(1, min(PIPELINE_PREFILL_STEP if hosts > 1 else MLX_LM_PREFILL_STEP, workload.prompt - 1))
    rows = costing.decode_batch if workload.concurrent else 1
    context = workload.prompt + workload.generated / 2
    prefill: list[list[float]] = []
    decode: list[list[float]] = []
    for k in range(stage_count):
        stage = _stage(k, 0, n, tp, costing.facts)
        per_chunk = [layer_times(work, stage, m, chunk, workload.prompt / 2, net, whole, caches=1)
                     for m in stage.machines]
        per_step = [layer_times(work, stage, m, rows, context, net, whole) for m in stage.machines]
        prefill.append([max(column) / chunk for column in zip(*per_chunk, strict=True)])
        decode.append([max(column) / rows for column in zip(*per_step, strict=True)])
    first = _stage(0, 0, n, tp, costing.facts)
    head_decode = max(head_time(work, first, m, rows, net, whole) for m in first.machines) / rows
    head_prefill = max(head_time(work, first, m, 1, net, whole) for m in first.machines) / max(workload.prompt, 1)
    return PhaseCosts(prefill, decode, head_prefill, head_decode, workload.prompt, workload.generated,
                      workload.concurrent)
