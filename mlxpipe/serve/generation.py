"""One request's generation as an API door reads it: its deltas from the first token to the last, its log line,
and the walk every door's reply takes, streamed or in one body.

Whatever the door's dialect, a reply is the same walk: tokens from the queue's ``Stream`` become text
(``serve.text.Reply``: stop strings, reasoning, tool calls), a stop string or a client that goes away cancels
the request on the ranks, a reply whose text fails ends that request alone, and the request log gets one line.
A stream opens, carries each delta, and ends with its closing or, once it has begun, an error as its last
event; a reply in one body is a response, or an error response when the reply failed. The door supplies only
its shapes (``ReplyShapes``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxpipe import console
from mlxpipe.errors import MlxpipeError, RequestFailed, UsageError
from mlxpipe.protocol.request import Request as GenerationRequest
from mlxpipe.serve.door import ApiError, ClientGone, admit, failure, gone, until
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.stream import Outcome, Sampled, Stream
from mlxpipe.serve.text import Delta, Reply

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Server-sent events as they come: no cache, and no buffering by a proxy (nginx's X-Accel-Buffering).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE = "text/event-stream"


async def start(queue: RequestQueue, tokenizer: TokenizerWrapper, log: RequestLog, http: Request,
                request: GenerationRequest, stops: list[str], door: str, notes: list[str] | None = None) -> Generation:
    """``request`` admitted, sent to the ranks, and its first token there; raises ``ApiError`` (429, the pipeline's
    503, a request a rank refused) or ``ClientGone`` (``http``'s client went away). Nothing is sent to the client
    before this returns, so a request that waited for the ranks and gave up is a plain error in its door's
    shape. ``door`` names the API in the request's log line, with ``notes``: what its body asked that was dropped
    or mapped."""
    admit(queue)
    try:
        stream = queue.submit(request, asyncio.get_running_loop())
    except UsageError as e:
        raise ApiError(400, e.message) from None
    except MlxpipeError as e:  # the pipeline gave up
        raise failure(e) from None
    generation = Generation(queue, tokenizer, log, request, stream, stops, door, notes)
    try:
        first = await until(stream.peek(), http)
    except ClientGone:
        generation.cancel()
        generation.log("cancelled")
        raise
    if isinstance(first, Outcome) and first.error is not None:
        generation.outcome = first
        generation.log()
        error = failure(first.error)
        error.logged = True  # its line is the request's own
        raise error
    return generation


def initial_state(tokenizer: TokenizerWrapper, prompt: list[int]) -> str:
    """Where the reply's text starts, as ``mlx_lm.server`` decides it: in the model's reasoning when the prompt
    ends inside an open think block (templates that open one for the reply), or in the state the tokenizer's
    response format names; else in plain text."""
    opened = (tokenizer.has_thinking and bool(prompt)
              and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt))
    state: str = tokenizer.response_initial_state or ("reasoning" if opened else "normal")
    return state


class ReplyShapes(Protocol):
    """A door's shapes of one reply: what ``stream`` and ``whole`` write as they walk it."""

    def opening(self) -> list[str]:
        """A stream's first lines, before any delta."""

    def add(self, delta: Delta) -> list[str]:
        """``delta`` into the reply; its lines when streamed. May raise ``RequestFailed`` (a tool call that
        cannot be parsed): the reply ends there, with that error."""

    def closing(self) -> list[str]:
        """A stream's last lines, once the reply is complete."""

    def failed(self, error: ApiError) -> str:
        """A stream's last line when the reply fails after it began."""

    def body(self) -> dict[str, Any]:
        """The whole reply as one body, once it is complete."""

    def error_response(self, error: ApiError) -> Response:
        """An error answered in one body, in the door's shape."""


async def respond(generation: Generation, shapes: ReplyShapes, http: Request, streaming: bool,
                  media_type: str = SSE, headers: Mapping[str, str] | None = STREAM_HEADERS) -> Response:
    """The reply streamed (``media_type``, with ``headers``) or in one body (``whole``)."""
    if streaming:
        return StreamingResponse(stream(generation, shapes), media_type=media_type, headers=headers)
    return await whole(generation, shapes, http)


async def stream(generation: Generation, shapes: ReplyShapes) -> AsyncIterator[str]:
    """The reply's lines: its opening, each delta's and its closing; an error after the first line is the last."""
    for line in shapes.opening():
        yield line
    deltas = generation.deltas()
    try:
        async for delta in deltas:
            for line in shapes.add(delta):
                yield line
    except RequestFailed as e:
        await deltas.aclose()
        yield shapes.failed(failure(e))
        return
    if generation.error is not None:
        yield shapes.failed(failure(generation.error))
        return
    for line in shapes.closing():
        yield line


async def whole(generation: Generation, shapes: ReplyShapes, http: Request) -> Response:
    """The whole reply as one body; a client that goes away before it is ready cancels it."""
    try:
        error = await until(generation.each(shapes.add), http)
    except ClientGone:
        return gone(http)
    if error is not None:
        return shapes.error_response(failure(error))
    return JSONResponse(shapes.body())


class Generation:
    """One request, from its first token to its last."""

    def __init__(self, queue: RequestQueue, tokenizer: TokenizerWrapper, log: RequestLog, request: GenerationRequest,
                 stream: Stream, stops: list[str], door: str = "", notes: list[str] | None = None) -> None:
        self.queue, self.log_file, self.request, self.stream = queue, log, request, stream
        self.door, self.notes = door, list(notes or [])
        self.reply = Reply(tokenizer, stops, initial_state(tokenizer, request.tokens or []))
        self.outcome: Outcome | None = None
        self._logged = False
        self.logprobs: list[Sampled] = []  # every shown token's, when the request asked for logprobs
        self._logprobs_taken = 0

    def take_logprobs(self) -> list[Sampled]:
        """The logprobs of the tokens since the last call (a stream's chunk carries its own tokens')."""
        taken, self._logprobs_taken = self.logprobs[self._logprobs_taken:], len(self.logprobs)
        return taken

    @property
    def error(self) -> MlxpipeError | None:
        """Why the request failed, once it has."""
        return self.outcome.error if self.outcome is not None else None

    def cancel(self) -> None:
        """Stop the request on the ranks."""
        self.queue.cancel(self.request.id)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The reply's deltas until it ends; cancels it on the ranks when this stops early."""
        done = False
        try:
            while True:
                item = await self.stream.next()
                if isinstance(item, Outcome):
                    self.outcome = item
                    if item.error is not None:
                        done = True
                        return
                    break
                token = item.token if isinstance(item, Sampled) else item
                if isinstance(item, Sampled) and token not in self.reply.tokenizer.eos_token_ids:
                    self.logprobs.append(item)  # as its text: the end-of-sequence token is not shown
                delta = self._text(lambda: self.reply.add(token))  # noqa: B023 - called here, at once
                if delta is None:
                    break  # this reply's text failed: it ends here, with the error
                if delta:
                    yield delta
                if self.reply.stopped:  # a stop string: nothing more is wanted
                    self.cancel()
                    break
            done = True
            last = self._text(lambda: self.reply.finish(self.finish_reason))
            if last:
                yield last
        finally:
            if not done:
                self.cancel()  # the client went away
            self.log()

    async def each(self, add: Callable[[Delta], object]) -> MlxpipeError | None:
        """Feed every delta of the reply to ``add``: the error that ended it, or None once it is complete."""
        deltas = self.deltas()
        try:
            async for delta in deltas:
                add(delta)
        except RequestFailed as e:
            await deltas.aclose()
            return e
        return self.error

    def _text(self, step: Callable[[], Delta]) -> Delta | None:
        """A step of the reply's text; when it raises (a tokenizer's detokenizer, say), this request fails alone."""
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - one reply's text: that request ends, the server does not
            self.cancel()
            self.outcome = Outcome(error=RequestFailed(f"turning its tokens into text failed: {type(e).__name__}: {e}"))
            return None

    @property
    def finish_reason(self) -> str:
        """``stop``, ``length`` or ``tool_calls``."""
        if self.reply.stopped:
            return "stop"
        reason = self.outcome.finish_reason if self.outcome else None
        if reason == "stop" and self.reply.made_tool_call:
            return "tool_calls"
        return "length" if reason == "length" else "stop"

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self.reply.stop_string

    @property
    def prompt_tokens(self) -> int:
        tokens = self.request.tokens
        assert tokens is not None  # every door sends the prompt as token ids
        return len(tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.reply.tokens)

    @property
    def cached_tokens(self) -> int:
        return self.outcome.cached_tokens if self.outcome else 0

    def log(self, status: str | None = None) -> None:
        """The request's line in the request log (once)."""
        if self._logged:
            return
        self._logged = True
        record = self._record(status)
        self.log_file.write(record)
        ttft_text = f"{record['ttft']:.2f} s" if record["ttft"] is not None else "-"
        busy = "/".join(f"{b:.0%}" for b in record["busy"])
        where = ", ".join(w for w in (self.door, self.queue.label) if w)  # a fleet's pipeline too
        door = f" ({where})" if where else ""
        line = (f"{record['id']}{door}: {record['status']}, prompt {record['prompt_tokens']} "
                f"({record['cached_tokens']} cached), {record['generation_tokens']} tokens, ttft {ttft_text}, "
                f"{record['tps']:.1f} tok/s" + (f", ranks busy {busy}" if busy else ""))
        if record["error"]:
            line += f"; error: {record['error'][:300]}"
        if self.notes:
            line += "; " + "; ".join(self.notes)
        if self.stream.resumed:  # its ranks failed while it ran: the failure, the pause, the tokens prefilled again
            line += "; " + "; ".join(r.describe() for r in self.stream.resumed)
        console.note(line, style="yellow" if record["error"] else "dim")

    def _record(self, status: str | None) -> dict[str, Any]:
        stream, outcome = self.stream, self.outcome
        now = time.monotonic()
        ttft = (stream.first_token - stream.submitted) if stream.first_token else None
        tokens = len(self.reply.tokens)
        after_first = now - stream.first_token if stream.first_token else 0.0
        error = outcome.error.message if outcome and outcome.error else None
        status = status or ("error" if error else
                            ("cancelled" if outcome is None and not self.reply.stopped else self.finish_reason))
        return {
            "id": self.request.id, "door": self.door, "status": status, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": outcome.cached_tokens if outcome else 0,
            "cache_tier": outcome.cache_tier if outcome and outcome.cached_tokens else None,
            "generation_tokens": tokens,
            "ttft": ttft, "tps": tokens / after_first if after_first > 0 else 0.0,
            "seconds": now - stream.submitted, "error": error,
            # Each rank's busy fraction so far (rank order): where the pipeline's time goes.
            "busy": [round(t["busy"], 3) for _, t in sorted(self.queue.time.items())],
            **({"notes": self.notes} if self.notes else {}),
            **({"resumed": [{"after": r.cause, "pause": r.pause, "replayed": r.replayed} for r in stream.resumed]}
               if stream.resumed else {}),
            **({"pipeline": self.queue.label} if self.queue.label else {}),
        }
