"""``mlxpipe generate`` and ``chat``: run a model as a pipeline and stream its answer.

The controller plans, makes sure every host has its files, checks that the
model can be pipelined, starts one worker per rank through ``mlx.launch``,
and then talks to the ranks through requests (stdin) and events (stdout).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mlxpipe.cluster import storage
from mlxpipe.defaults import DEFAULT_LOAD_TIMEOUT, DEFAULT_STEP_TIMEOUT
from mlxpipe.errors import LaunchError, RequestFailed
from mlxpipe.launch.ranks import LaunchSpec, Ranks, lease_for
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.request import DEFAULT_NUM_DRAFT_TOKENS, Request
from mlxpipe.cluster.target import Target

if TYPE_CHECKING:
    from mlxpipe.launch.batch import BatchResult, RequestResult

PIPELINE_MODES = ("generic", "native")
WORKER = ("-m", "mlxpipe.worker")

OnText = Callable[[str], None]


@dataclass(frozen=True)
class RankStats:
    rank: int
    host: str
    start: int
    end: int
    peak_memory_gb: float
    load_seconds: float | None = None
    stage: int | None = None  # with --tp: the rank's pipeline stage and place in its group (None without)
    tp_index: int | None = None


@dataclass
class Answer:
    """One generation's text and figures."""

    text: str
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    ttft: float | None = None
    finish_reason: str | None = None
    draft_tokens: int | None = None  # --draft-model: generated tokens that were the draft's, accepted
    error: str | None = None  # why the request failed (finish_reason "error")
    tokens: list[int] = field(default_factory=list)
    ranks: list[RankStats] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunOptions:
    backend: str = "ring"
    mode: str = "generic"
    prefill_step_size: int = 2048
    port: int | None = None
    load_timeout: float = DEFAULT_LOAD_TIMEOUT
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    trust_remote_code: bool = False
    adapter_path: str | None = None
    draft_paths: tuple[str, ...] | None = None  # the draft model's directory on each rank's host
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    tp: int = 1  # ranks per tensor-parallel group (the plan's split is then per stage)


def job_spec(meta: ModelMetadata, plan: Plan, target: Target, options: RunOptions) -> Any:
    """The worker's JobSpec: each rank's model directory on its own host, and the split (per stage with tp > 1:
    every member of a group runs its stage's layers, from its own host's copy of the stage's files)."""
    from mlxpipe.worker.job import JobSpec

    hosts = target.hostfile.hosts
    return JobSpec(
        model_paths=[storage.model_path(h, meta) for h in hosts],
        split=list(plan.split),
        mode=options.mode,
        trust_remote_code=options.trust_remote_code,
        prefill_step_size=options.prefill_step_size,
        adapter_path=options.adapter_path,
        draft_paths=list(options.draft_paths) if options.draft_paths is not None else None,
        num_draft_tokens=options.num_draft_tokens,
        # Only with groups: a job without tp stays readable by a worker without tensor parallelism.
        **({"tp": options.tp} if options.tp != 1 else {}),
    )


def controller_model_dir(meta: ModelMetadata) -> Path:
    """A directory on this machine with the model's config and tokenizer (the pre-launch check, serve's tokenizer)."""
    if meta.local:
        return Path(meta.source)
    from mlxpipe.hub.client import download_file
    from mlxpipe.hub.errors import hub_errors

    with hub_errors(meta.source):
        for name in meta.support_files:
            if "/" not in name:
                download_file(meta.source, name, revision=meta.commit)
        return Path(download_file(meta.source, "config.json", revision=meta.commit)).parent


class Pipeline:
    """A loaded pipeline on the cluster, ready for requests.

    ``worker`` is what each rank runs before ``--job`` (tests substitute a worker
    that misbehaves on purpose).
    """

    def __init__(self, meta: ModelMetadata, plan: Plan, target: Target, options: RunOptions,
                 worker: Sequence[str] = WORKER, train: dict[str, Any] | None = None) -> None:
        self.meta, self.plan, self.target, self.options = meta, plan, target, options
        self.job = job_spec(meta, plan, target, options)
        if train is not None:  # the ranks fine-tune instead of serving requests (mlxpipe.lora.run)
            self.job = replace(self.job, train=train)
        # Ranks get these on mlx.launch's (and ssh's) command line: never a secret here.
        env = (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"))
        self.spec = LaunchSpec(
            hostfile=target.hostfile,
            worker_args=(*worker, "--job", self.job.encode()),
            backend=options.backend,
            env=env,
            port=options.port,
            lease=lease_for(options.step_timeout),
        )
        self.ranks = Ranks(self.spec)
        self.loaded: dict[int, RankStats] = {}

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    def start(self, on_loaded: Callable[[RankStats], None] | None = None) -> None:
        """Start every rank and wait until each has loaded its layers."""
        self.ranks.start()
        for event in self.ranks.events(self.options.load_timeout):
            if event.get("event") == "loaded":
                rank = int(event["rank"])
                stats = _rank_stats(event, self.target.hostfile.hosts[rank].ssh, self.plan)
                self.loaded[stats.rank] = stats
                if on_loaded:
                    on_loaded(stats)
                if len(self.loaded) == self.ranks.size:
                    return
        raise LaunchError("the ranks ended before loading the model", f"logs: {self.run_dir}")

    def generate(self, request: Request, on_text: OnText | None = None) -> Answer:
        """Send one request; stream rank 0's text; return once every rank is done."""
        # Every rank must sample the same token: they share one seed.
        request = request.with_seed(lambda: random.randrange(2**31))
        self.ranks.send({"type": "generate", **request.to_wire()})
        answer = Answer(text="")
        done: set[int] = set()
        peaks: dict[int, float] = {}
        for event in self.ranks.events(self.options.step_timeout):
            kind = event.get("event")
            if kind == "token":
                answer.text += event.get("text", "")
                if on_text and event.get("text"):
                    on_text(event["text"])
            elif kind == "done":
                rank = int(event["rank"])
                done.add(rank)
                peaks[rank] = float(event.get("peak_memory", 0.0))
                if rank == 0:
                    answer.tokens = [int(t) for t in event.get("tokens", [])]
                    for key in ("prompt_tokens", "prompt_tps", "generation_tokens", "generation_tps", "ttft", "finish_reason",
                                "draft_tokens", "error"):
                        if key in event:
                            setattr(answer, key, event[key])
                if len(done) == self.ranks.size:
                    break
        else:
            raise LaunchError("the ranks ended in the middle of a request", f"logs: {self.run_dir}")
        if answer.finish_reason == "error":
            raise RequestFailed(f"the request failed: {answer.error}", "the pipeline is fine: change the request")
        answer.ranks = self._rank_stats(peaks)
        return answer

    def generate_batch(
        self,
        requests: Sequence[Request],
        concurrency: int | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
        on_finished: Callable[[RequestResult], None] | None = None,
        decode_batch: int = 1,
    ) -> BatchResult:
        """Overlap ``requests`` across the stages, ``concurrency`` at a time, up to ``decode_batch``
        requests per decode micro-batch (default concurrency: ``decode_batch`` per stage).

        ``on_result`` gets each request's result in input order, as soon as it
        and every request before it have finished; ``on_finished`` gets each
        the moment it finishes.
        """
        from mlxpipe.launch.batch import BatchResult, InOrder, result_from_event, with_seeds

        concurrency = concurrency or self.ranks.size * decode_batch
        wire = [r.to_wire() for r in with_seeds(list(requests))]
        self.ranks.send({"type": "batch", "requests": wire, "concurrency": concurrency,
                         "decode_batch": decode_batch})
        ordered = InOrder(on_result)
        done: dict[int, dict[str, Any]] = {}
        for event in self.ranks.events(self.options.step_timeout):
            kind = event.get("event")
            if kind == "result":
                finished = result_from_event(event)
                if on_finished is not None:
                    on_finished(finished)
                ordered.add(int(event["index"]), finished)
            elif kind == "batch_done":
                done[int(event["rank"])] = event
                if len(done) == self.ranks.size:
                    break
        else:
            raise LaunchError("the ranks ended in the middle of a batch", f"logs: {self.run_dir}")
        if len(ordered.results) != len(requests):
            raise LaunchError(
                f"rank 0 reported {len(ordered.results)} of {len(requests)} results", f"logs: {self.run_dir}"
            )
        return BatchResult(
            results=[ordered.results[i] for i in range(len(requests))],
            seconds=float(done[0].get("seconds", 0.0)),
            concurrency=concurrency,
            ranks=self._rank_stats({r: float(e.get("peak_memory", 0.0)) for r, e in done.items()}),
            decode_batch=int(done[0].get("decode_batch", 1)),
            time={r: e["time"] for r, e in done.items() if "time" in e},
        )

    def _rank_stats(self, peaks: dict[int, float]) -> list[RankStats]:
        """The ranks' stats, peak memory raised to what the last request reported."""
        return [
            replace(s, peak_memory_gb=max(s.peak_memory_gb, peaks.get(s.rank, 0.0)))
            for s in sorted(self.loaded.values(), key=lambda s: s.rank)
        ]

    def close(self) -> None:
        self.ranks.close()

    def stop(self) -> None:
        self.ranks.stop()


def _rank_stats(event: dict[str, Any], host: str, plan: Plan) -> RankStats:
    start, end = event.get("layers", (0, 0))
    rank = int(event["rank"])
    planned = plan.ranks[rank] if plan.tp > 1 and 0 <= rank < len(plan.ranks) else None
    return RankStats(
        stage=planned.stage if planned else None,
        tp_index=planned.tp_index if planned else None,
        rank=rank,
        host=host,
        start=int(start),
        end=int(end),
        peak_memory_gb=float(event.get("peak_memory", 0.0)),
        load_seconds=event.get("load_seconds"),
    )


def request_for(prompt: str | None, messages: Sequence[dict[str, str]] | None, options: Request,
                keep_cache: bool = False) -> Request:
    """``options`` (the command's flags) for this prompt or these messages."""
    return replace(options, prompt=prompt, messages=list(messages) if messages is not None else None,
                   keep_cache=keep_cache)
