"""The controller's ``Pipeline``: a loaded pipeline's ranks, and what ``generate``, ``chat`` and
``generate --prompts-file`` ask of them.

``launch.run`` plans, makes sure every host has its files, checks that the model
can be pipelined and starts one worker per rank through ``mlx.launch``; the
``Pipeline`` then talks to the ranks through messages (stdin) and events (stdout),
``protocol``'s types both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpipe.defaults import DEFAULT_LOAD_TIMEOUT
from mlxpipe.errors import LaunchError, RequestFailed, UsageError
from mlxpipe.launch.batch import RankStats
from mlxpipe.launch.command import LaunchSpec, lease_for
from mlxpipe.launch.ranks import Ranks
from mlxpipe.model.metadata import ModelMetadata
from mlxpipe.plan.shard import Plan
from mlxpipe.protocol.events import EVENTS, TRAIN_EVENTS, BatchDone, Done, Loaded, Result, Token
from mlxpipe.protocol.job import TrainSpec
from mlxpipe.protocol.message import Event
from mlxpipe.protocol.messages import Batch, Generate
from mlxpipe.protocol.request import Request

if TYPE_CHECKING:
    from mlxpipe.launch.batch import BatchResult, RequestResult
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.vision.prompt import VisionPrompt

OnText = Callable[[str], None]


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


def controller_model_dir(meta: ModelMetadata) -> Path:
    """A directory on this machine with the model's config and tokenizer (the pre-launch check, serve's tokenizer)."""
    if meta.local:
        return Path(meta.source)
    from mlxpipe.hub.client import download_file
    from mlxpipe.hub.faults import hub_errors

    with hub_errors(meta.source):
        for name in meta.support_files:
            if "/" not in name:
                download_file(meta.source, name, revision=meta.commit)
        return Path(download_file(meta.source, "config.json", revision=meta.commit)).parent


class Pipeline:
    """The controller's handle on a loaded pipeline on the cluster, ready for requests.

    ``config.worker`` is what each rank runs before ``--job`` (tests substitute a worker
    that misbehaves on purpose); with ``train`` the ranks fine-tune instead of serving
    requests (``mlxpipe.lora.training``).
    """

    def __init__(self, meta: ModelMetadata, plan: Plan, config: PipelineConfig, train: TrainSpec | None = None) -> None:
        self.meta, self.plan, self.config = meta, plan, config
        self.job = config.job_spec(meta, plan, train)
        self.registry = TRAIN_EVENTS if train is not None else EVENTS  # what its ranks say
        # Ranks get these on mlx.launch's (and ssh's) command line: never a secret here.
        env = (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"))
        self.spec = LaunchSpec(
            hostfile=config.target.hostfile,
            worker_args=(*config.worker, "--job", self.job.encode()),
            backend=config.chosen_backend,
            env=env,
            port=config.ring_port(),
            lease=lease_for(config.timeout),
        )
        self.ranks = Ranks(self.spec)
        self.loaded: dict[int, RankStats] = {}
        # The model's processor here, made at the first request with images.
        self._vision_prompt: VisionPrompt | None = None

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    def events(self, timeout: float, busy: Callable[[], bool] | None = None) -> Iterator[Event]:
        """The ranks' events, typed (``Ranks.events``: the watchdog's ``timeout``, raising on any failure)."""
        for data in self.ranks.events(timeout, busy):
            yield self.registry.from_wire(data)

    def start(self, on_loaded: Callable[[RankStats], None] | None = None) -> None:
        """Start every rank and wait until each has loaded its layers."""
        self.ranks.start()
        for event in self.events(DEFAULT_LOAD_TIMEOUT):
            if isinstance(event, Loaded):
                stats = _rank_stats(event, self.config.target.hostfile.hosts[event.rank].ssh, self.plan)
                self.loaded[stats.rank] = stats
                if on_loaded:
                    on_loaded(stats)
                if len(self.loaded) == self.ranks.size:
                    return
        raise LaunchError("the ranks ended before loading the model", f"logs: {self.run_dir}")

    def with_images(self, request: Request) -> Request:
        """A request with images, its prompt tokenized by the model's processor here (``vision.prompt``); a
        model that takes no images refuses it before anything reaches a rank."""
        if not request.images:
            return request
        from mlxpipe.vision.prompt import VisionPrompt, is_vision_config, require_vision

        require_vision()
        if not self.job.vision:
            why = "" if is_vision_config(self.meta.config) else ": it is a text-only model"
            raise UsageError(f"{self.meta.source} takes no images{why}")
        if self._vision_prompt is None:
            self._vision_prompt = VisionPrompt(controller_model_dir(self.meta), self.meta.config)
        return self._vision_prompt.tokenize(request)

    def generate(self, request: Request, on_text: OnText | None = None) -> Answer:
        """Send one request; stream rank 0's text; return once every rank is done."""
        # Every rank must sample the same token: they share one seed.
        request = self.with_images(request).with_seed(lambda: random.randrange(2**31))
        self.ranks.send(Generate(request))
        answer = Answer(text="")
        done: set[int] = set()
        peaks: dict[int, float] = {}
        for event in self.events(self.config.timeout):
            if isinstance(event, Token) and event.text is not None:
                answer.text += event.text
                if on_text and event.text:
                    on_text(event.text)
            elif isinstance(event, Done):
                done.add(event.rank)
                peaks[event.rank] = event.peak_memory
                if event.rank == 0:
                    _fill(answer, event)
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
        requests per decode micro-batch (default concurrency: ``decode_batch`` per stage,
        ``PipelineConfig.concurrency``).

        ``on_result`` gets each request's result in input order, as soon as it
        and every request before it have finished; ``on_finished`` gets each
        the moment it finishes.
        """
        from mlxpipe.launch.batch import BatchResult, InOrder, result_from_event, with_seeds

        concurrency = concurrency or self.config.concurrency(decode_batch)
        self.ranks.send(Batch(tuple(with_seeds(list(requests))), concurrency, decode_batch))
        ordered = InOrder(on_result)
        done: dict[int, BatchDone] = {}
        for event in self.events(self.config.timeout):
            if isinstance(event, Result):
                finished = result_from_event(event)
                if on_finished is not None:
                    on_finished(finished)
                ordered.add(event.index, finished)
            elif isinstance(event, BatchDone):
                done[event.rank] = event
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
            seconds=done[0].seconds,
            concurrency=concurrency,
            ranks=self._rank_stats({r: e.peak_memory for r, e in done.items()}),
            decode_batch=done[0].decode_batch,
            time={r: e.time for r, e in done.items() if e.time is not None},
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


def _fill(answer: Answer, done: Done) -> None:
    """Rank 0's ``done``: the answer's tokens and figures."""
    answer.tokens = list(done.tokens)
    answer.prompt_tokens, answer.prompt_tps = done.prompt_tokens, done.prompt_tps
    answer.generation_tokens, answer.generation_tps = done.generation_tokens, done.generation_tps
    answer.ttft, answer.finish_reason = done.ttft, done.finish_reason
    answer.draft_tokens, answer.error = done.draft_tokens, done.error


def _rank_stats(event: Loaded, host: str, plan: Plan) -> RankStats:
    start, end = event.layers
    planned = plan.ranks[event.rank] if plan.tp > 1 and 0 <= event.rank < len(plan.ranks) else None
    return RankStats(
        stage=planned.stage if planned else None,
        tp_index=planned.tp_index if planned else None,
        rank=event.rank,
        host=host,
        start=start,
        end=end,
        peak_memory_gb=event.peak_memory,
        load_seconds=event.load_seconds,
    )


def request_for(prompt: str | None, messages: Sequence[dict[str, Any]] | None, options: Request,
                keep_cache: bool = False) -> Request:
    """``options`` (the command's flags) for this prompt or these messages."""
    return replace(options, prompt=prompt, messages=list(messages) if messages is not None else None,
                   keep_cache=keep_cache)
