"""What rank 0 tells the controller about the engine's requests: text, tokens, results and their figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mlxpipe.protocol.events import Finished, Result, Token
from mlxpipe.protocol.messages import RequestId
from mlxpipe.protocol.request import Request
from mlxpipe.worker.context import RankContext
from mlxpipe.worker.generation.schedule import Schedule
from mlxpipe.worker.progress import Emit

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxpipe.worker.generation.sampling import Samplers


@dataclass
class Timing:
    """Rank 0's clock for one request."""

    admitted: float
    first_token: float | None = None


class EngineView(Protocol):
    """What reporters read of the engine (``engine.Engine``): a protocol, so that the engine imports the
    reporters and not the reverse."""

    rank: int
    context: RankContext
    schedule: Schedule
    requests: list[Request]
    eos: dict[int, set[int]]  # each request's end-of-sequence ids
    errors: dict[int, str]  # why a request ended with "error"
    sampling: Samplers  # rank 0's: a request's last token's logprobs, when asked
    cache_tiers: dict[int, str]  # where a request's cached tokens came from: "memory" or "disk"


class Reporter(Protocol):
    """What rank 0 tells the controller about requests (the other ranks report nothing)."""

    def token(self, engine: EngineView, index: int, token: int) -> None: ...

    def finished(self, engine: EngineView, index: int, timing: Timing, now: float) -> None: ...


def text_of(tokenizer: TokenizerWrapper, tokens: list[int], eos_ids: set[int] | None = None) -> str:
    """The text ``stream_generate`` would have streamed: the end-of-sequence token is not shown."""
    eos_ids = tokenizer.eos_token_ids if eos_ids is None else eos_ids
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        if token not in eos_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    text: str = detokenizer.text
    return text


def _error(engine: EngineView, index: int) -> str | None:
    """Why a request failed, for its event (None when it did not)."""
    state = engine.schedule.requests[index]
    if state.finish_reason != "error":
        return None
    return engine.errors.get(index, "the request failed on another rank")


@dataclass
class BatchReporter:
    """``generate --prompts-file``: one ``result`` event per request, with its text and figures."""

    emit: Emit

    def token(self, engine: EngineView, index: int, token: int) -> None:
        pass

    def finished(self, engine: EngineView, index: int, timing: Timing, now: float) -> None:
        state = engine.schedule.requests[index]
        request = engine.requests[index]
        tokens = state.generated
        first = timing.first_token or now
        after_first = now - first
        self.emit(Result(
            rank=engine.rank,
            index=index,
            id=request.id if request.id is not None else index,
            tokens=tokens,
            text=text_of(engine.context.loaded.tokenizer, tokens, engine.eos.get(index)),
            prompt_tokens=len(state.prompt),
            generation_tokens=len(tokens),
            finish_reason=state.finish_reason,
            ttft=first - timing.admitted,
            latency=now - timing.admitted,
            # As mlx-lm's stream_generate: every token over the time after the first.
            generation_tps=len(tokens) / after_first if after_first > 0 else 0.0,
            slot=state.slot,
            ticks=[state.admitted_tick, state.finished_tick],
            error=_error(engine, index),
        ))


@dataclass
class StreamReporter:
    """``serve``: every token as it is sampled, then ``finished`` (the controller makes the text)."""

    emit: Emit

    def token(self, engine: EngineView, index: int, token: int) -> None:
        logprobs = engine.sampling.logprobs.pop(index, None)
        logprob, top = logprobs if logprobs is not None else (None, None)
        self.emit(Token(rank=0, id=engine.requests[index].id, token=token, logprob=logprob, top=top))

    def finished(self, engine: EngineView, index: int, timing: Timing, now: float) -> None:
        state = engine.schedule.requests[index]
        self.emit(Finished(
            rank=0,
            id=engine.requests[index].id,
            finish_reason=state.finish_reason,
            prompt_tokens=len(state.prompt),
            cached_tokens=state.cached,
            generation_tokens=len(state.generated),
            error=_error(engine, index),
            cache_tier=engine.cache_tiers.get(index),
        ))


class TextReporter:
    """``generate`` and ``chat``: rank 0 streams text as mlx-lm's ``stream_generate`` does.

    Each token's new text goes out as a ``token`` event as soon as it is
    sampled (the end-of-sequence token shows no text); the timing figures of
    the one request are kept for the ``done`` event.
    """

    def __init__(self, emit: Emit, tokenizer: TokenizerWrapper, request_id: RequestId = None) -> None:
        self.emit, self.request_id = emit, request_id
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.figures: dict[str, Any] = {}  # ``Done``'s fields of rank 0's clock

    def token(self, engine: EngineView, index: int, token: int) -> None:
        if token in engine.eos.get(index, self.eos_ids):  # the request's own, --extra-eos-token included
            return
        self.detokenizer.add_token(token)
        self._send(self.detokenizer.last_segment, token)

    def finished(self, engine: EngineView, index: int, timing: Timing, now: float) -> None:
        self.detokenizer.finalize()
        self._send(self.detokenizer.last_segment, None)
        state = engine.schedule.requests[index]
        first = timing.first_token or now
        fed = len(state.prompt) - state.cached
        self.figures = {
            # As stream_generate: the tokens fed over the time to the first token, then
            # every token over the time after the first.
            "prompt_tps": fed / (first - timing.admitted) if first > timing.admitted else 0.0,
            "generation_tps": len(state.generated) / (now - first) if now > first else 0.0,
            "ttft": first - timing.admitted,
            "error": _error(engine, index),
        }

    def _send(self, text: str, token: int | None) -> None:
        if not text and token is None:
            return  # every shown token gets its event; the end only when text is left
        self.emit(Token(rank=0, text=text, token=token, id=self.request_id))
