"""Many prompts at once (``mlxpipe generate --prompts-file``): the file, the results, the figures.

The prompts file holds one prompt per line, or JSON Lines (a ``.jsonl`` file,
or one whose first non-blank line starts with ``{``) with per-prompt options::

    {"prompt": "What is MLX?", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Hi"}], "temp": 0.7, "seed": 1}

The ranks overlap the requests across the pipeline's stages
(``mlxpipe.worker.generation.engine``); this module turns the file into requests and the
ranks' ``result`` events into per-request results and a summary.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxpipe.errors import UsageError
from mlxpipe.launch.timing import where_time_goes
from mlxpipe.paths import replacing
from mlxpipe.protocol.checks import at_least
from mlxpipe.protocol.events import Result
from mlxpipe.protocol.request import Request, parse_logit_bias


def check_decode_batch(decode_batch: int) -> int:
    """``--decode-batch`` as given when it is at least 1; else ``UsageError`` (the ranks' rule, ``at_least``)."""
    return at_least(decode_batch, 1, "--decode-batch")

_NUMBER = (int, float)
# Per-prompt options a JSONL line may set (``Request``'s fields: mlx_lm.generate's flags without
# the dashes), with the JSON types they take.
_OPTIONS: dict[str, tuple[type, ...]] = {
    "id": (str, int),
    "prompt": (str,),
    "messages": (list,),
    "system_prompt": (str,),
    "ignore_chat_template": (bool,),
    "use_default_chat_template": (bool,),
    "chat_template_config": (dict,),
    "prefill_response": (str,),
    "max_tokens": (int,),
    "temp": _NUMBER,
    "top_p": _NUMBER,
    "min_p": _NUMBER,
    "min_tokens_to_keep": (int,),
    "top_k": (int,),
    "xtc_probability": _NUMBER,
    "xtc_threshold": _NUMBER,
    "seed": (int,),
    "logit_bias": (dict,),
    "repetition_penalty": _NUMBER,
    "repetition_context_size": (int,),
    "presence_penalty": _NUMBER,
    "presence_context_size": (int,),
    "frequency_penalty": _NUMBER,
    "frequency_context_size": (int,),
    "extra_eos_token": (str, list),
    "max_kv_size": (int,),
    "num_draft_tokens": (int,),
    "kv_bits": (int,),
    "kv_group_size": (int,),
    "quantized_kv_start": (int,),
}


@dataclass(frozen=True)
class RankStats:
    """One rank's figures of a run: its layers, host, load time and peak memory."""

    rank: int
    host: str
    start: int
    end: int
    peak_memory_gb: float
    load_seconds: float | None = None
    stage: int | None = None  # with --tp: the rank's pipeline stage and place in its group (None without)
    tp_index: int | None = None


@dataclass
class RequestResult:
    """One request of a batch: its text and figures (times in seconds, from its admission)."""

    id: Any
    text: str
    tokens: list[int]
    prompt_tokens: int
    generation_tokens: int
    latency: float
    ttft: float
    tps: float  # generation tok/s as mlx-lm computes it: tokens / time after the first
    finish_reason: str | None = None  # "stop", "length", or "error" (then ``error`` says why)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BatchResult:
    """Every request's result in input order, and the batch's aggregate figures."""

    results: list[RequestResult]
    seconds: float  # rank 0's wall time for the whole batch
    concurrency: int
    ranks: list[RankStats] = field(default_factory=list)
    decode_batch: int = 1  # requests per decode micro-batch, as the ranks ran it
    time: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> engine.TimeSpent.report()

    @property
    def generation_tokens(self) -> int:
        return sum(r.generation_tokens for r in self.results)

    @property
    def failed(self) -> list[RequestResult]:
        """The requests that ended with an error (each alone: the others ran to their end)."""
        return [r for r in self.results if r.error is not None]

    @property
    def aggregate_tps(self) -> float:
        """Generated tokens of all requests over the batch's wall time."""
        return self.generation_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.results),
            "concurrency": self.concurrency,
            "decode_batch": self.decode_batch,
            "generation_tokens": self.generation_tokens,
            "failed": len(self.failed),
            "seconds": self.seconds,
            "aggregate_tps": self.aggregate_tps,
            "ranks": [asdict(r) for r in self.ranks],
            "time": where_time_goes(self.time),
        }


def read_prompts(path: Path, defaults: Request) -> list[Request]:
    """The requests in ``path``, each ``defaults`` (the command's flags) overridden by its own options.

    A request's id is its JSONL ``id``, else its line number. Errors name the
    file and the line.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the prompts file {path}: {e}") from e
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"{path}: no prompts (the file is empty)")
    jsonl = path.suffix == ".jsonl" or numbered[0][1].lstrip().startswith("{")
    requests = []
    for n, line in numbered:
        options = _parse_line(path, n, line) if jsonl else {"prompt": line}
        request = replace(defaults, **{"id": n, "prompt": None, "messages": None, **options})
        requests.append(_checked(request, f"{path}:{n}"))
    return requests


def _parse_line(path: Path, n: int, line: str) -> dict[str, Any]:
    """One JSONL line's options, checked."""
    where = f"{path}:{n}"
    try:
        options = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(options, dict):
        raise UsageError(f"{where}: expected a JSON object with a prompt or messages")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(_OPTIONS)}")
    for key, value in options.items():
        types = _OPTIONS[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise UsageError(f"{where}: {key!r} must be {names}, got {json.dumps(value)}")
    if ("prompt" in options) == ("messages" in options):
        raise UsageError(f"{where}: give exactly one of 'prompt' and 'messages'")
    messages = options.get("messages")
    if messages is not None and not (messages and all(_is_message(m) for m in messages)):
        raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    if "logit_bias" in options:
        options["logit_bias"] = parse_logit_bias(options["logit_bias"], f"{where}: 'logit_bias'")
    eos = options.get("extra_eos_token")
    if eos is not None:
        eos = [eos] if isinstance(eos, str) else eos
        if not all(isinstance(t, str) for t in eos):
            raise UsageError(f"{where}: 'extra_eos_token' must be a string or a list of strings")
        options["extra_eos_token"] = tuple(eos)
    return options


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _checked(request: Request, where: str) -> Request:
    """``request`` once in range, else one line naming the line (a ``RequestError``, a usage error)."""
    return request.check(lambda field: f"{where}: '{field}'")


def with_seeds(requests: list[Request]) -> list[Request]:
    """Give every sampled request without a seed a random one, so a run can be repeated from its output."""
    return [r.with_seed(lambda: random.randrange(2**31)) for r in requests]


def result_from_event(event: Result) -> RequestResult:
    """A ``result`` event of rank 0 as a ``RequestResult``."""
    return RequestResult(
        id=event.id,
        text=event.text,
        tokens=list(event.tokens),
        prompt_tokens=event.prompt_tokens,
        generation_tokens=event.generation_tokens,
        latency=event.latency,
        ttft=event.ttft,
        tps=event.generation_tps,
        finish_reason=event.finish_reason,
        error=event.error,
    )


class InOrder:
    """Hands results to ``callback`` in input order, holding back those that finish early."""

    def __init__(self, callback: Callable[[RequestResult], None] | None) -> None:
        self.callback = callback
        self.results: dict[int, RequestResult] = {}
        self._next = 0

    def add(self, index: int, result: RequestResult) -> None:
        self.results[index] = result
        while self._next in self.results:
            if self.callback:
                self.callback(self.results[self._next])
            self._next += 1


class ResultsFile:
    """``--output``: every result kept the moment it finishes; the file itself written whole.

    While the batch runs, results go to ``<output>.partial`` in the order they
    finish, one flushed JSON line each, so a run that fails keeps everything it
    finished. At the end the results are written in input order to a temporary
    file that is renamed over ``output``: an existing ``output`` is replaced
    whole or not at all.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self.saved = 0
        try:
            self._file = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 - open until finish()
        except OSError as e:
            raise UsageError(f"--output {path}: cannot write {self.partial}: {e.strerror or e}") from e

    def add(self, result: RequestResult) -> None:
        """Keep one finished result (any order)."""
        self._file.write(json.dumps(result.to_json()) + "\n")
        self._file.flush()
        self.saved += 1

    def finish(self, results: list[RequestResult]) -> None:
        """Write every result in input order to ``path``; drop the partial file."""
        self._file.close()
        try:
            with replacing(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for r in results:
                    f.write(json.dumps(r.to_json()) + "\n")
        except OSError as e:
            raise UsageError(
                f"cannot write {self.path}: {e.strerror or e}",
                f"all {self.saved} results are in {self.partial}",
            ) from e
        self.partial.unlink(missing_ok=True)

    def abandon(self) -> str | None:
        """After a failure: keep what finished; say where, or None when nothing did."""
        self._file.close()
        if self.saved == 0:
            self.partial.unlink(missing_ok=True)
            return None
        return f"the {self.saved} results that finished are in {self.partial}"
