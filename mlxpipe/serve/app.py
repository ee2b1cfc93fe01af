"""The OpenAI-compatible HTTP API of ``mlxpipe serve`` (Starlette).

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(streaming as server-sent events ending with ``data: [DONE]``, or one JSON
body) and ``GET /health``. Shapes follow OpenAI's, so the ``openai`` package
and any OpenAI client work unchanged; every error is a 4xx/5xx with OpenAI's
``{"error": {"message", "type", "param", "code"}}`` naming the field at fault.

No body can break the server: every field is checked (``Request.check``)
before anything reaches a rank, a failure of one request ends that request
alone, and a response starts only once its first token (or its error) is
there, so a request that waited for the ranks to load and gave up still gets a
plain 503. A client that goes away, at any moment, costs one line in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxpipe import console
from mlxpipe.errors import MlxpipeError, RequestFailed, UsageError
from mlxpipe.prompts import prompt_tokens
from mlxpipe.request import Request as GenerationRequest
from mlxpipe.request import RequestError, parse_logit_bias
from mlxpipe.serve.controller import DEFAULT_MAX_BODY_BYTES, Job, Outcome, RequestLog, ServeEngine, Stream

T = TypeVar("T")
from mlxpipe.serve.text import Delta, Reply, tool_calls

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000  # characters of one stop string
MAX_TOOLS = 128
# A body over the limit is read to its end (and dropped) so that the client reads the 413, up to this many times
# the limit; beyond, the connection is closed.
_DRAIN_FACTOR = 16
# How often a request answered in one body checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class ServerSettings:
    model_id: str
    api_key: str | None
    context: int  # the longest prompt + completion the model takes (--context, else the model's own)
    defaults: GenerationRequest = GenerationRequest()  # the server's flags; a body overrides its options
    vocab_size: int | None = None  # the model's: logit_bias may name no token beyond it
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass
class Parsed:
    """A validated request body."""

    job: Job
    stream: bool
    include_usage: bool
    stops: list[str]
    tools: list[Any] | None


def build_app(engine: ServeEngine, tokenizer: Any, settings: ServerSettings, log: RequestLog) -> Starlette:
    """The Starlette app serving ``engine``."""
    api = _Api(engine, tokenizer, settings, log)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    return app


class _Api:
    def __init__(self, engine: ServeEngine, tokenizer: Any, settings: ServerSettings, log: RequestLog) -> None:
        self.engine, self.tokenizer, self.settings, self.log = engine, tokenizer, settings, log

    # --- endpoints -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        body = self.engine.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as e:
            return e.response()
        model = {"id": self.settings.model_id, "object": "model", "created": 0, "owned_by": "mlxpipe"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            self._authorize(request)
            body = await _read_json(request, self.settings.max_body_bytes)
            parsed = self._parse(body, chat)
            self._admit()
            stream = self.engine.submit(parsed.job, asyncio.get_running_loop())
        except ApiError as e:
            return e.response()
        except UsageError as e:
            return ApiError(400, e.message).response()
        except MlxpipeError as e:  # the pipeline gave up
            return _failure(e).response()
        except ClientDisconnect:
            return _gone(request)
        run = _Run(self, parsed, stream, chat)
        # Nothing is sent before the first token or the error: a request that waited for the ranks
        # and gave up is a plain 503, a request refused by a rank a plain error.
        first = await _until(stream.peek(), request)
        if first is None:
            self.engine.cancel(parsed.job.id)
            run.log("cancelled")
            return _gone(request)
        if isinstance(first, Outcome) and first.error is not None:
            run.outcome = first
            run.log()
            return _failure(first.error).response()
        if parsed.stream:
            return StreamingResponse(run.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await run.whole(request)

    # --- checks --------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                           code="invalid_api_key", kind="authentication_error")

    def _admit(self) -> None:
        """Room for one more request (it waits here while the ranks load or relaunch), else 429."""
        engine = self.engine
        if engine.in_flight >= engine.capacity:
            raise ApiError(429, f"{engine.in_flight} requests in flight, the most this server takes "
                                f"(--max-concurrency + --max-queue); try again shortly",
                           code="rate_limit_exceeded", kind="rate_limit_error", headers={"Retry-After": "1"})

    def _parse(self, body: dict[str, Any], chat: bool) -> Parsed:
        model = body.get("model")
        if model is not None and model != self.settings.model_id:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.settings.model_id!r}",
                           param="model", code="model_not_found")
        n = _field(body, "n", int, 1)
        if n != 1:
            raise ApiError(400, f"'n' must be 1 (one completion per request), got {n}", param="n")
        request = self._options(body)
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, None) or {}
        include_usage = bool(options.get("include_usage", False))
        stops = _stops(body)
        tools = _field(body, "tools", list, None) if chat else None
        if tools is not None and len(tools) > MAX_TOOLS:
            raise ApiError(400, f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
        tokens = self._tokens(body, chat, tools, request)
        if len(tokens) + 1 > self.settings.context:
            param = "messages" if chat else "prompt"
            raise ApiError(400, f"'{param}' makes a prompt of {len(tokens)} tokens; this server's context is "
                                f"{self.settings.context} tokens", param=param, code="context_length_exceeded")
        max_tokens = min(request.max_tokens, self.settings.context - len(tokens))
        job = replace(request, id=self.engine.new_id(), tokens=tokens, max_tokens=max_tokens)
        return Parsed(job, stream, include_usage, stops, tools)

    def _options(self, body: dict[str, Any]) -> GenerationRequest:
        """The body's options over the server's defaults, checked; errors name the body's field."""
        values: dict[str, Any] = {}
        for name, (key, types) in _BODY_OPTIONS.items():
            value = _field(body, name, types, None)
            if value is not None:
                values[key] = value
        max_tokens = _field(body, "max_completion_tokens", int, None)
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        names = {key: name for name, (key, _) in _BODY_OPTIONS.items()}
        if max_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        try:
            if "logit_bias" in values:
                values["logit_bias"] = parse_logit_bias(values["logit_bias"], "'logit_bias'")
            return replace(self.settings.defaults, **values).check(lambda key: f"'{names.get(key, key)}'",
                                                                   self.settings.vocab_size)
        except RequestError as e:
            raise ApiError(400, e.message, param=names.get(e.field, e.field)) from None

    def _tokens(self, body: dict[str, Any], chat: bool, tools: list[Any] | None,
                options: GenerationRequest) -> list[int]:
        if chat:
            messages = _field(body, "messages", list, None)
            if not messages:
                raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
            request = replace(options, messages=[_message(m, i) for i, m in enumerate(messages)])
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
            request = replace(options, prompt=prompt, ignore_chat_template=True)
        try:
            tokens = prompt_tokens(self.tokenizer, request, tools)
        except UsageError as e:
            raise ApiError(400, e.message, param="messages" if chat else "prompt") from None
        except Exception as e:  # noqa: BLE001 - a chat template that rejects these messages
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        if not tokens:
            raise ApiError(400, "the prompt has no tokens", param="messages" if chat else "prompt")
        return tokens


class _Run:
    """One request, from its first token to its last, as SSE chunks or one body."""

    def __init__(self, api: _Api, parsed: Parsed, stream: Stream, chat: bool) -> None:
        self.api, self.parsed, self.stream, self.chat = api, parsed, stream, chat
        self.reply = Reply(api.tokenizer, parsed.stops)
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + parsed.job.id
        self.outcome: Outcome | None = None
        self._logged = False

    async def _deltas(self) -> AsyncIterator[Delta]:
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
                delta = self._text(lambda: self.reply.add(item))
                if delta is None:
                    break  # this reply's text failed: it ends here, with the error
                if delta:
                    yield delta
                if self.reply.stopped:  # a stop string: nothing more is wanted
                    self.api.engine.cancel(self.parsed.job.id)
                    break
            done = True
            last = self._text(lambda: self.reply.finish(self.finish_reason))
            if last:
                yield last
        finally:
            if not done:
                self.api.engine.cancel(self.parsed.job.id)  # the client went away
            self.log()

    def _text(self, step: Callable[[], Delta]) -> Delta | None:
        """A step of the reply's text; when it raises (a tokenizer's detokenizer, say), this request fails alone."""
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - one reply's text: that request ends, the server does not
            self.api.engine.cancel(self.parsed.job.id)
            self.outcome = Outcome(error=RequestFailed(f"turning its tokens into text failed: {type(e).__name__}: {e}"))
            return None

    @property
    def finish_reason(self) -> str:
        if self.reply.stopped:
            return "stop"
        reason = self.outcome.finish_reason if self.outcome else None
        if reason == "stop" and self.reply.made_tool_call:
            return "tool_calls"
        return "length" if reason == "length" else "stop"

    def usage(self) -> dict[str, Any]:
        prompt = len(self.parsed.job.tokens)
        completion = len(self.reply.tokens)
        cached = self.outcome.cached_tokens if self.outcome else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _tool_calls(self, texts: list[str]) -> list[dict[str, Any]]:
        try:
            return tool_calls(self.api.tokenizer, texts, self.parsed.tools, self.parsed.stream)
        except Exception as e:  # noqa: BLE001 - the model wrote a tool call its parser cannot read
            raise RequestFailed(f"the model's tool call could not be parsed: {type(e).__name__}: {e}") from None

    # --- one body --------------------------------------------------------------------

    async def whole(self, request: Request) -> Response:
        """The whole reply as one body; a client that goes away before it is ready cancels it."""
        collected = await _until(self._collect(), request)  # a cancelled _deltas cancels it on the ranks
        if collected is None:
            return _gone(request)
        text, reasoning, calls = collected
        if self.outcome is not None and self.outcome.error is not None:
            return _failure(self.outcome.error).response()
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                try:
                    message["tool_calls"] = self._tool_calls(calls)
                except RequestFailed as e:
                    return _failure(e).response()
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
        return JSONResponse({**self._head(False), "choices": [choice], "usage": self.usage()})

    async def _collect(self) -> tuple[str, str, list[str]]:
        text, reasoning, calls = "", "", []
        async for delta in self._deltas():
            text, reasoning = text + delta.text, reasoning + delta.reasoning
            calls.extend(delta.tool_calls)
        return text, reasoning, calls

    # --- server-sent events ------------------------------------------------------------

    async def events(self) -> AsyncIterator[str]:
        if self.chat:
            yield _sse({**self._head(True), "choices": [self._choice({"role": "assistant", "content": ""})]})
        deltas = self._deltas()
        try:
            async for delta in deltas:
                yield _sse({**self._head(True), "choices": [self._choice(self._delta(delta))]})
        except RequestFailed as e:
            await deltas.aclose()
            yield _sse(_failure(e).body())
            return
        if self.outcome is not None and self.outcome.error is not None:
            yield _sse(_failure(self.outcome.error).body())
            return
        yield _sse({**self._head(True), "choices": [self._choice({} if self.chat else "", self.finish_reason)]})
        if self.parsed.include_usage:
            yield _sse({**self._head(True), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    def _delta(self, delta: Delta) -> Any:
        if not self.chat:
            return delta.text
        out: dict[str, Any] = {}
        if delta.text:
            out["content"] = delta.text
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            out["tool_calls"] = self._tool_calls(delta.tool_calls)
        return out

    def _choice(self, delta: Any, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"index": 0, "text": delta, "finish_reason": finish_reason, "logprobs": None}

    def _head(self, streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.api.settings.model_id}

    # --- the request log -------------------------------------------------------------

    def log(self, status: str | None = None) -> None:
        """The request's line in the request log (once)."""
        if self._logged:
            return
        self._logged = True
        stream, outcome = self.stream, self.outcome
        now = time.monotonic()
        ttft = (stream.first_token - stream.submitted) if stream.first_token else None
        tokens = len(self.reply.tokens)
        after_first = now - stream.first_token if stream.first_token else 0.0
        error = outcome.error.message if outcome and outcome.error else None
        status = status or ("error" if error else
                            ("cancelled" if outcome is None and not self.reply.stopped else self.finish_reason))
        record = {
            "id": self.parsed.job.id, "status": status, "prompt_tokens": len(self.parsed.job.tokens),
            "cached_tokens": outcome.cached_tokens if outcome else 0, "generation_tokens": tokens,
            "ttft": ttft, "tps": tokens / after_first if after_first > 0 else 0.0,
            "seconds": now - stream.submitted, "error": error,
            # Each rank's busy fraction so far (rank order): where the pipeline's time goes.
            "busy": [round(t["busy"], 3) for _, t in sorted(self.api.engine.time.items())],
        }
        self.api.log.write(record)
        ttft_text = f"{ttft:.2f} s" if ttft is not None else "-"
        busy = "/".join(f"{b:.0%}" for b in record["busy"])
        console.err.print(
            f"[dim]{record['id']}: {status}, prompt {record['prompt_tokens']} ({record['cached_tokens']} cached), "
            f"{tokens} tokens, ttft {ttft_text}, {record['tps']:.1f} tok/s"
            + (f", ranks busy {busy}" if busy else "") + "[/]"
        )


# --- body parsing ---------------------------------------------------------------------

_NUMBER = (int, float)
# Body field -> (Request field, JSON types): OpenAI's names, and mlx_lm.server's for the rest.
_BODY_OPTIONS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("max_tokens", int),
    "temperature": ("temp", _NUMBER),
    "top_p": ("top_p", _NUMBER),
    "min_p": ("min_p", _NUMBER),
    "top_k": ("top_k", int),
    "xtc_probability": ("xtc_probability", _NUMBER),
    "xtc_threshold": ("xtc_threshold", _NUMBER),
    "seed": ("seed", int),
    "logit_bias": ("logit_bias", dict),
    "repetition_penalty": ("repetition_penalty", _NUMBER),
    "repetition_context_size": ("repetition_context_size", int),
    "presence_penalty": ("presence_penalty", _NUMBER),
    "presence_context_size": ("presence_context_size", int),
    "frequency_penalty": ("frequency_penalty", _NUMBER),
    "frequency_context_size": ("frequency_context_size", int),
    "chat_template_kwargs": ("chat_template_config", dict),
    "num_draft_tokens": ("num_draft_tokens", int),
}


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; over ``limit`` bytes, a 413 (the body read to its end first, up to a point, so
    that the client, still sending, reads the answer instead of a reset connection)."""
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    raw = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received <= limit and (declared is None or declared <= limit):
            raw += chunk
        elif received > _DRAIN_FACTOR * limit:
            break  # too much to read only to refuse it: the connection closes
    if received > limit or (declared is not None and declared > limit):
        raise ApiError(413, f"the body has {declared or received} bytes, over this server's limit of {limit} "
                            "(--max-body-size)", code="request_too_large",
                       headers={"Connection": "close"} if received > _DRAIN_FACTOR * limit else None)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity (Python's reader takes them)."""
    raise ValueError(f"{name} is not a JSON value")


async def _until(item: Awaitable[T], request: Request) -> T | None:
    """``item``, or None when the client goes away first (checked every ``DISCONNECT_POLL_SECONDS``)."""
    task = asyncio.ensure_future(item)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def _gone(request: Request) -> Response:
    """The client went away: nobody reads the answer (nginx's 499), and one line says so."""
    console.err.print(f"[dim]{request.method} {request.url.path}: the client went away[/]")
    return Response(status_code=499)


def _field(body: dict[str, Any], name: str, types: Any, default: Any) -> Any:
    """``body[name]`` checked against ``types`` (bools are not numbers), or ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = " or ".join({int: "an integer", float: "a number", bool: "a boolean", list: "a list",
                             dict: "an object", str: "a string"}[t] for t in allowed)
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(value)[:60]}", param=name)
    return value


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                            "characters", param="stop")
    return [s for s in stops if s]


def _message(m: Any, i: int) -> dict[str, Any]:
    """A chat message for the template: string content, or the text of its parts."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'role'", param=where)
    content = m.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, f"'{where}.content' may hold only text parts", param=f"{where}.content")
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
    return {**m, "content": content if content is not None else ""}


def _failure(error: Exception) -> ApiError:
    """A request that failed alone (500), or whose pipeline failed or never came up (503)."""
    message = getattr(error, "message", str(error))
    hint = getattr(error, "hint", None)
    text = f"{message} ({hint})" if hint else message
    if isinstance(error, RequestFailed):
        return ApiError(500, text, code="request_failed", kind="server_error")
    return ApiError(503, text, code="pipeline_failed", kind="server_error", headers={"Retry-After": "5"})


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
