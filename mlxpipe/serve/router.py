"""One endpoint for a fleet's pipelines (``serve --fleet``): each request goes to the pipeline of the model it names.

The doors stay as they are, each built around one pipeline (its queue, tokenizer and settings: a ``Served``); the
router builds every door once per pipeline and puts one route in front of each of their routes. A request that
names a model (every ``POST``) has its body read once here, its ``model`` looked up among the entries' names, and
goes to that entry's door, which reads the same body (``door.ROUTED_BODY``); a name no entry answers to is a 404 in
the door's own shape listing the names (``--any-model-name``: the first entry takes it). Of an entry's replicas the
request goes to a ready one, else one loading or restarting, else any: among them the one that was sent the longest
prefix of its conversation, when that is at least half of it (``serve.prefixes``: a returning conversation lands
where its cache is, and a system prompt many conversations share does not pile them on one), then the least loaded,
then the one whose latest request is the oldest. ``/v1/models``,
``/api/tags`` and ``/api/ps`` list every entry's names, each as its own door lists them; ``/health`` says every
pipeline's state. While the server drains (SIGTERM) every pipeline's door answers a new request with its 503.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxpipe.serve import anthropic_api, anthropic_shapes, ollama_api, openai_api, openai_shapes, responses_api
from mlxpipe.serve.door import ROUTED_BODY, ApiError, ServerSettings, authorize, gone, read_json, refused
from mlxpipe.serve.prefixes import Prefixes, chain
from mlxpipe.serve.queue import RequestLog, RequestQueue
from mlxpipe.serve.responses_store import ResponseStore

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

Endpoint = Callable[[Request], Awaitable[Response]]

# The lists every entry's door gives its own part of, by path, and the key of the list in the body.
_LISTS = {"/v1/models": "data", "/api/tags": "models", "/api/ps": "models"}
# A pipeline's state, the better first: where a request for an entry of several replicas goes.
_PREFERRED = ("ready", "loading", "restarting", "failed")
# The share of a request's prefix parts (by weight) a replica must have been sent for the request to go there first.
MIN_SHARE = 0.5


@dataclass(frozen=True)
class Served:
    """One pipeline behind the endpoint: what its doors are built around, and its name in the server's output."""

    label: str  # "small", or "small#1" for the second replica of an entry of several
    queue: RequestQueue
    tokenizer: TokenizerWrapper
    settings: ServerSettings
    log: RequestLog


@dataclass(frozen=True)
class _Door:
    """A door's kind: how it is built, its name in the output, its error shape, the suffix its clients add."""

    build: Callable[[Served, ResponseStore], Any]
    name: str
    error_response: Callable[[ApiError], Response]
    suffix: str = ""  # Ollama's clients call a model "name:latest"


_DOORS = (
    _Door(lambda s, _: openai_api.OpenAIApi(s.queue, s.tokenizer, s.settings, s.log), openai_api.DOOR,
          openai_shapes.error_response),
    _Door(lambda s, _: anthropic_api.AnthropicApi(s.queue, s.tokenizer, s.settings, s.log), anthropic_api.DOOR,
          anthropic_shapes.error_response),
    # One store for every pipeline: a previous_response_id is found whichever model answered it.
    _Door(lambda s, store: responses_api.ResponsesApi(s.queue, s.tokenizer, s.settings, s.log, store),
          responses_api.DOOR, openai_shapes.error_response),
    _Door(lambda s, _: ollama_api.OllamaApi(s.queue, s.tokenizer, s.settings, s.log), ollama_api.DOOR,
          ollama_api.error_response, ":latest"),
)


class Router:
    """Every entry's pipelines (``entries``: each entry's replicas, in the fleet file's order) behind one set of
    routes."""

    def __init__(self, entries: Sequence[Sequence[Served]], any_model_name: bool = False) -> None:
        self.entries = [list(e) for e in entries]
        self.any_model_name = any_model_name
        self.served = [s for e in self.entries for s in e]
        self.first = self.served[0]
        self.prefixes = [Prefixes() for _ in self.served]  # what each pipeline was sent (by its place in served)
        self.picks = 0  # requests routed so far
        self.last = [0 for _ in self.served]  # each pipeline's latest request, by its number among them (0: none)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the endpoint answers to, entry by entry."""
        return tuple(n for e in self.entries for n in e[0].settings.model_names)

    def pick(self, name: str | None, body: Mapping[str, Any] | None = None) -> Served | None:
        """The pipeline for a request naming ``name`` (None: it names none, the first entry takes it), or None when
        no entry answers to it; of several replicas, the pipeline picked remembers ``body``'s prefix."""
        entry = self._entry(name)
        if entry is None:
            return None
        places = [self.served.index(s) for s in entry]
        keys = chain(body) if body is not None and len(entry) > 1 else None

        def rank(place: int) -> tuple[int, int, int, int]:
            queue = self.served[place].queue
            state = _PREFERRED.index(queue.state) if queue.state in _PREFERRED else 0
            match = self.prefixes[place].match(keys) if keys else 0
            if keys and match < MIN_SHARE * keys[-1][1]:
                match = 0  # a prefix shared by many conversations (a system prompt) must not pile them on one
            return state, -match, queue.in_flight, self.last[place]

        place = min(places, key=rank)
        self.picks += 1
        self.last[place] = self.picks
        if keys:
            self.prefixes[place].add(keys)
        return self.served[place]

    def _entry(self, name: str | None) -> list[Served] | None:
        if name is None:
            return self.entries[0]
        for entry in self.entries:
            if name in entry[0].settings.model_names:
                return entry
        return self.entries[0] if self.any_model_name else None

    def unknown(self, name: str) -> ApiError:
        """The 404 of a name no entry answers to, listing the names."""
        names = ", ".join(repr(n) for n in self.names)
        return ApiError(404, f"the model {name[:80]!r} does not exist; this server serves {names}", param="model",
                        code="model_not_found")

    def routes(self) -> list[Route]:
        """One route per door route, in front of every pipeline's door, and ``/health``."""
        store = ResponseStore()
        routes = [Route("/health", self.health, methods=["GET"])]
        for kind in _DOORS:
            doors = [kind.build(s, store).routes() for s in self.served]
            for k, route in enumerate(doors[0]):
                endpoints = [d[k].endpoint for d in doors]
                routes.append(Route(route.path, self._handler(kind, route.path, route.methods or set(), endpoints),
                                    methods=sorted(route.methods or ())))
        return routes

    def _handler(self, kind: _Door, path: str, methods: set[str], endpoints: list[Endpoint]) -> Endpoint:
        if path in _LISTS:
            return self._listing(_LISTS[path], endpoints)
        if "POST" in methods:
            return self._routed(kind, endpoints)
        return endpoints[0]  # names no model (a stored response, the version): the first pipeline's door

    def _routed(self, kind: _Door, endpoints: list[Endpoint]) -> Endpoint:
        async def routed(request: Request) -> Response:
            try:
                authorize(request, self.first.settings.api_key)
                body = await read_json(request, self.first.settings.max_body_bytes)
                name = body.get("model")
                # A name that is no string goes to the first entry, whose door refuses it in its own words.
                name = name.removesuffix(kind.suffix) if isinstance(name, str) and kind.suffix else name
                served = self.pick(name if isinstance(name, str) else None, body)
                if served is None:
                    raise self.unknown(str(name))
            except ApiError as e:
                return kind.error_response(refused(self.first.log, request, kind.name, e))
            except ClientDisconnect:
                return gone(request)
            request.scope[ROUTED_BODY] = body
            return await endpoints[self.served.index(served)](request)

        return routed

    def _listing(self, key: str, endpoints: list[Endpoint]) -> Endpoint:
        """Each entry's list (its first replica's: replicas answer to the same names), one after the other."""
        firsts = [self.served.index(e[0]) for e in self.entries]

        async def listing(request: Request) -> Response:
            bodies = []
            for i in firsts:
                response = await endpoints[i](request)
                if response.status_code != 200:  # a refusal (the API key): the same for every entry
                    return response
                bodies.append(json.loads(bytes(response.body)))
            return JSONResponse({**bodies[0], key: [item for body in bodies for item in body[key]]})

        return listing

    async def health(self, request: Request) -> Response:
        """``ready`` once every pipeline is; ``draining`` once the server drains (SIGTERM: every pipeline does);
        else the least ready one's state; and each pipeline's health."""
        pipelines = [{"name": s.label, **s.queue.health()} for s in self.served]
        states = [p["status"] for p in pipelines]
        if all(s == "ready" for s in states):
            status = "ready"
        elif "draining" in states:
            status = "draining"
        else:
            status = max(states, key=lambda s: _PREFERRED.index(s) if s in _PREFERRED else 0)
        return JSONResponse({"status": status, "pipelines": pipelines}, status_code=200 if status == "ready" else 503)
