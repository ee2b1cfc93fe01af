"""``--layout auto``: every feasible layout of a model on a hostfile, estimated, and the one a workload wants.

Pure, over the model's metadata, the hosts and the cluster's facts. The feasible layouts: a
pipeline with each split strategy, ``--tp T`` for each group size T that divides the hosts and the
model's heads (one group: pure tensor parallelism; several: tensor x pipeline, each strategy), each
one whose every rank fits. ``choose`` ranks them by the seconds one request of the workload takes
(``Workload``); ``fewer_hosts`` finds a layout on the first hosts alone that beats a given one
(``doctor``'s warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpipe.defaults import DEFAULT_CONTEXT
from mlxpipe.errors import MlxpipeError
from mlxpipe.host import Host
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.cluster_facts import ClusterFacts
from mlxpipe.plan.estimate import Costing, Estimate, estimate
from mlxpipe.plan.model_work import model_work
from mlxpipe.plan.parallel_layout import Layout, Workload
from mlxpipe.plan.shard import Plan, make_plan
from mlxpipe.plan.tensor import divisors

STRATEGY_ORDER = ("balanced", "even", "memory")
TIE = 0.01  # layouts within 1% of each other's score are a tie: the simpler one (fewer groups, then fewer stages) wins


@dataclass(frozen=True)
class Candidate:
    """A feasible layout, its plan and what it is predicted to do."""

    layout: Layout
    plan: Plan
    estimate: Estimate
    strategies: tuple[str, ...]  # every strategy that gives this split

    @property
    def name(self) -> str:
        if self.layout.stages == 1 or len(self.strategies) == 1:
            return self.layout.name
        return self.layout.name.replace(f" {self.layout.strategy} ", f" {'/'.join(self.strategies)} ")


@dataclass(frozen=True)
class Choice:
    """The layouts of one model on one hostfile, best first, and why the first."""

    candidates: tuple[Candidate, ...]
    refused: tuple[tuple[str, str], ...]  # (layout, why it is not feasible)
    workload: Workload
    measured: bool  # the facts were measured (else: nominal hosts and links)

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def runner_up(self) -> Candidate | None:
        return self.candidates[1] if len(self.candidates) > 1 else None

    @property
    def reason(self) -> str:
        """Why the chosen layout: its workload time against the runner-up's, and the figures that make it."""
        best, second = self.chosen, self.runner_up
        e = best.estimate
        head = f"{best.name}: {self.workload.describes} is predicted to take {e.score:.2f} s"
        if second is None:
            return f"{head}, the only feasible layout"
        s = second.estimate
        return (f"{head} against {s.score:.2f} s with {second.name}, the runner-up "
                f"(decode {e.decode:.1f} vs {s.decode:.1f} tok/s, prefill {e.prefill:.1f} vs {s.prefill:.1f} tok/s, "
                f"{e.concurrency} at once {e.aggregate:.1f} vs {s.aggregate:.1f} tok/s)")


def candidates(meta: ModelMetadata, hosts: Sequence[Host], workload: Workload, *, facts: ClusterFacts | None = None,
               backend: str = "ring", context: int | None = None, strategy: str | None = None,
               tps: Sequence[int] | None = None, prompt: int | None = None) -> Choice:
    """Every feasible layout over all of ``hosts``, estimated and ranked for ``workload`` (``strategy``, ``tps``:
    only these; ``prompt``: estimate prefill at this prompt length instead of the workload's)."""
    costing = Costing(model_work(meta), facts, backend)
    size = len(hosts)
    found: dict[tuple[int, tuple[int, ...]], Candidate] = {}
    refused: list[tuple[str, str]] = []
    for tp in tps or divisors(size):
        if size % tp:
            continue
        stages = size // tp
        for name in (strategy,) if strategy else _strategies(hosts, stages):
            label = f"tp {tp}" if tp > 1 else "pipeline"
            try:
                plan = make_plan(meta, hosts, strategy=name, tp=tp, facts=facts, workload=workload, backend=backend,
                                 context=context or DEFAULT_CONTEXT)
            except MlxpipeError as e:
                refused.append((f"{label} {name}" if stages > 1 else label, e.message))
                break  # the group size itself is refused (heads, or more stages than layers)
            layout = Layout(tp, plan.split, plan.strategy, size)
            if not plan.fits:
                refused.append((layout.name, "a rank does not hold its share"))
                continue
            key = (tp, plan.split)
            if key in found:
                found[key] = _also(found[key], plan.strategy)
                continue
            found[key] = Candidate(layout, plan, estimate(costing, layout, workload, prompt=prompt), (plan.strategy,))
    ranked = sorted(found.values(), key=lambda c: c.estimate.score)
    return Choice(tuple(_settle_ties(ranked)), tuple(refused), workload, facts is not None)


def _strategies(hosts: Sequence[Host], stages: int) -> tuple[str, ...]:
    if stages == 1:
        return ("even",)  # one stage holds every layer: no split to choose
    return tuple(s for s in STRATEGY_ORDER if s != "memory" or all(h.memory_gb for h in hosts))


def _also(candidate: Candidate, strategy: str) -> Candidate:
    return Candidate(candidate.layout, candidate.plan, candidate.estimate, (*candidate.strategies, strategy))


def _settle_ties(ranked: list[Candidate]) -> list[Candidate]:
    """Of layouts whose scores are within ``TIE`` of the best, the simplest first: predictions are not that exact,
    and fewer groups and stages mean fewer links that can be slower than measured."""
    if not ranked:
        return ranked
    best = ranked[0].estimate.score
    tied = [c for c in ranked if c.estimate.score <= best * (1 + TIE)]
    simplest = min(tied, key=lambda c: (c.layout.tp > 1, c.layout.stages, c.estimate.score))
    return [simplest] + [c for c in ranked if c is not simplest]


def fewer_hosts(meta: ModelMetadata, hosts: Sequence[Host], current: Candidate, workload: Workload, *,
                facts: ClusterFacts | None = None, backend: str = "ring",
                context: int | None = None) -> Candidate | None:
    """The best layout on the hostfile's first k < all hosts that beats ``current`` for ``workload``, if any."""
    best: Candidate | None = None
    for k in range(1, len(hosts)):
        choice = candidates(meta, hosts[:k], workload, facts=facts, backend=backend, context=context)
        if choice.candidates and (best is None or choice.chosen.estimate.score < best.estimate.score):
            best = choice.chosen
    if best is not None and best.estimate.score < current.estimate.score * (1 - TIE):
        return best
    return None
