"""A request's sampling on a rank, made of mlx-lm's own pieces.

``make_sampler`` and ``make_logits_processors`` from ``mlx_lm.sample_utils``,
with the arguments ``mlx_lm.generate`` gives them, so a new mlx-lm option is one
field in ``mlxpipe.protocol.request.Request``. Overlapped requests sample in turns, so
they cannot share MLX's global random key: each request keeps its own, which is
made the global key around each call of mlx-lm's sampler (``mx.random.seed``
takes any 64-bit key) and read back after, so a seeded request samples exactly
what it samples alone after ``mx.random.seed(seed)``.

In the engine, rank 0 keeps each running request's sampling (``Samplers``):
its sampler, its logits processors, its grammar and the log-probabilities of
its last token; the other ranks sample nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Request
from mlxpipe.worker.generation.constraints import Constraint, request_grammar

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxpipe.worker.generation.schedule import RequestState

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def extra_eos_ids(tokenizer: TokenizerWrapper, tokens: tuple[str, ...]) -> set[int]:
    """The ids of ``--extra-eos-token`` values, read as ``TokenizerWrapper.add_eos_token`` reads them."""
    ids = set()
    for token in tokens:
        try:
            token_id = int(token)
        except ValueError:
            token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None:
            raise UsageError(f"--extra-eos-token {token!r} is not a token of this tokenizer",
                             hint="give a token of its vocabulary, or a token id")
        ids.add(int(token_id))
    return ids


def mlx_sampler(request: Request, tokenizer: TokenizerWrapper, eos_ids: set[int]) -> Sampler:
    """mlx-lm's sampler for ``request``, built as mlx_lm.generate builds it (XTC spares newline and EOS)."""
    return make_sampler(**request.sampler_kwargs(),
                        xtc_special_tokens=list(tokenizer.encode("\n")) + sorted(eos_ids))


def keyed_sampler(request: Request, tokenizer: TokenizerWrapper, eos_ids: set[int]) -> Sampler:
    """``mlx_sampler`` drawing from the request's own key (greedy needs none)."""
    sampler = mlx_sampler(request, tokenizer, eos_ids)
    return KeyedSampler(sampler, request.seed) if request.temp > 0 else sampler


def logits_processors(request: Request) -> list[LogitsProcessor]:
    return make_logits_processors(**request.logits_kwargs())


class KeyedSampler:
    """mlx-lm's ``sampler`` drawing from this request's own random key (see the module docstring)."""

    def __init__(self, sampler: Sampler, seed: int | None) -> None:
        self.sampler = sampler
        self.key = int(seed or 0)

    def __call__(self, logprobs: mx.array) -> mx.array:
        mx.random.seed(self.key)
        token = self.sampler(logprobs)
        after = cast(list[mx.array], mx.random.state)[0]  # mlx types its state as a plain object
        mx.eval(token, after)
        high, low = cast(list[int], after.tolist())
        self.key = (int(high) << 32) | int(low)
        return token

    def skip(self, draws: int, logprobs: mx.array) -> None:
        """Move the key past ``draws`` tokens drawn earlier (a resumed request's): mlx-lm's samplers draw the same
        random numbers whatever the logits, so drawing from ``logprobs``' shape of zeros moves it as they did."""
        zeros = mx.zeros_like(logprobs)
        for _ in range(draws):
            self(zeros)


TokenLogprobs = tuple[float, list[list[float]]]  # the token's logprob; the top tokens as [id, logprob], best first


def token_logprobs(logprobs: mx.array, token: int, top: int) -> TokenLogprobs:
    """The sampled ``token``'s log-probability in ``logprobs`` (one row: what the sampler was given) and the
    ``top`` most likely tokens', best first (ties: the lower id first, as ``argmax`` picks); tokens a grammar
    ruled out (``-inf``) are never listed."""
    row = logprobs.reshape(-1)
    chosen = float(cast(float, row[token].item()))  # mlx types item() as any scalar
    if top <= 0:
        return chosen, []
    top = min(top, row.size)
    order = mx.argpartition(-row, top - 1)[:top]  # the top ones, unordered: cheaper than sorting the vocabulary
    values = row[order]
    mx.eval(order, values)
    ids, logits = cast(list[int], order.tolist()), cast(list[float], values.tolist())
    ranked = sorted(zip(ids, logits, strict=True), key=lambda p: (-p[1], p[0]))
    return chosen, [[int(i), float(v)] for i, v in ranked if v != -float("inf")]


class Samplers:
    """Rank 0's sampling of the engine's requests, each its own: its sampler (on its own random key), its logits
    processors, its grammar (made at its first token), the log-probabilities of its last token when it asked."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer
        self.samplers: dict[int, Sampler] = {}
        self.processors: dict[int, list[LogitsProcessor]] = {}
        self.eos: dict[int, set[int]] = {}  # each request's end-of-sequence ids, its extra ones included
        self.constraints: dict[int, Constraint] = {}  # each constrained request's grammar
        self.logprobs: dict[int, TokenLogprobs] = {}  # the last token's, for its reporter (when asked)
        self.skips: dict[int, int] = {}  # a resumed request's draws made before it was resumed, not yet skipped

    def admit(self, index: int, request: Request, eos: set[int], processors: list[LogitsProcessor]) -> None:
        """A request starts: its sampler, with its logits ``processors`` (made for every rank's look at them)."""
        self.samplers[index] = keyed_sampler(request, self.tokenizer, eos)
        self.processors[index] = processors
        self.eos[index] = eos
        if request.resumed and isinstance(self.samplers[index], KeyedSampler):
            self.skips[index] = request.resumed

    def drop(self, index: int) -> None:
        """A request ended: its sampling goes."""
        for held in (self.samplers, self.processors, self.eos, self.constraints, self.logprobs, self.skips):
            held.pop(index, None)

    def sample(self, index: int, request: Request, state: RequestState, logits: mx.array) -> int:
        """``request``'s token from its row of logits, with its logits processors (which see every token fed so far,
        prompt and reply, as in generate_step), its grammar, its sampler, its random key."""
        processors = self.processors[index]
        if processors:
            history = mx.array([*state.prompt, *state.generated], dtype=mx.uint32)
            for processor in processors:
                logits = processor(history, logits)
        constraint = self._constraint(index, request, logits.shape[-1])
        if constraint is not None:  # after logit_bias and penalties: the grammar has the last word
            logits = mx.where(mx.array(constraint.allowed(logits.shape[-1])), logits, -mx.inf)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = self.samplers[index]
        if index in self.skips and isinstance(sampler, KeyedSampler):
            sampler.skip(self.skips.pop(index), logprobs)
        token = int(cast(int, sampler(logprobs).item()))  # mlx types item() as any scalar
        if constraint is not None:
            constraint.accept(token)
        if request.logprobs:  # from the very logprobs the sampler drew from
            self.logprobs[index] = token_logprobs(logprobs, token, request.top_logprobs)
        return token

    def lazy(self, requests: tuple[int, ...], logits: mx.array) -> mx.array:
        """The tokens of a decode step's rows (``requests``' last logits), left lazy: requests whose sampling has
        no host-side state (``ahead.lazy_sampling``)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.concatenate(
            [self.samplers[index](logprobs[row : row + 1]).reshape(1) for row, index in enumerate(requests)]
        ).astype(mx.int32)

    def _constraint(self, index: int, request: Request, width: int) -> Constraint | None:
        """The grammar state of a constrained request (structured output, tool calls), made at its first token
        (``width``: the logits', the model's vocabulary)."""
        if not request.constrained:
            return None
        if index not in self.constraints:
            constraint = Constraint(request_grammar(request, self.tokenizer), self.tokenizer, width, self.eos[index])
            if request.resumed:  # the reply so far, sent before the request was resumed
                assert request.tokens is not None
                for token in request.tokens[-request.resumed:]:
                    constraint.accept(token)
            self.constraints[index] = constraint
        return self.constraints[index]
