"""worker/generation/sampling.py: mlx-lm's samplers, each request on its own random key."""

from __future__ import annotations

from fixtures.schemas import PERSON, schema_format
from fixtures.tiny_models import VOCAB_SIZE, TinyModels


def test_interleaved_requests_each_sample_what_they_sample_alone() -> None:
    """mlx-lm's own sampler, each request on its own key: as alone after ``mx.random.seed(seed)``."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxpipe.worker.generation.sampling import KeyedSampler

    logits = mx.random.normal((1, 64), key=mx.random.key(0))
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    sampler = make_sampler(1.0, top_p=0.9, top_k=20, xtc_probability=0.5, xtc_threshold=0.05)
    alone = {}
    for seed in (7, 2**40 + 3):
        mx.random.seed(seed)
        alone[seed] = [sampler(logprobs).item() for _ in range(10)]
    keyed = {seed: KeyedSampler(sampler, seed) for seed in alone}
    together: dict[int, list[int]] = {seed: [] for seed in alone}
    for _ in range(10):
        for seed, sample in keyed.items():
            together[seed].append(sample(logprobs).item())
    assert together == alone
    assert len(set(alone[7])) > 1  # it does sample


def test_a_resumed_request_draws_after_skipping_what_it_drew_before() -> None:
    """Resumed after N tokens, a seeded request's sampler skips N draws (on logits of zeros) and then draws what it
    would have drawn next: the draws do not depend on the logits they were made from (XTC's included)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxpipe.worker.generation.sampling import KeyedSampler

    sampler = make_sampler(0.8, top_p=0.95, top_k=30, xtc_probability=0.5, xtc_threshold=0.05)
    rows = [mx.random.normal((1, 64), key=mx.random.key(i)) for i in range(12)]
    rows = [r - mx.logsumexp(r, keepdims=True) for r in rows]
    whole = KeyedSampler(sampler, 11)
    drawn = [whole(r).item() for r in rows]
    resumed = KeyedSampler(sampler, 11)
    resumed.skip(8, rows[0])
    assert [resumed(r).item() for r in rows[8:]] == drawn[8:]
    fresh = KeyedSampler(sampler, 11)  # without the skip it would draw otherwise: the test can fail
    assert [fresh(r).item() for r in rows[8:]] != drawn[8:]


def test_a_resumed_structured_request_samples_on_as_it_would_have(tiny_models: TinyModels) -> None:
    """Rank 0's sampling of a seeded, sampled request held to a JSON schema, stopped after 12 tokens and resumed
    (those 12 after its prompt, ``resumed=12``) on fresh ``Samplers``: its grammar reads them and its key skips their
    draws, so the next tokens are the ones the undisturbed request drew from the same logits."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from mlxpipe.protocol.request import Request
    from mlxpipe.worker.generation.sampling import Samplers

    tokenizer = load_tokenizer(tiny_models["llama"])
    eos = set(tokenizer.eos_token_ids)
    prompt = [5, 6, 7]
    request = Request(tokens=prompt, temp=1.0, seed=3, response_format=schema_format(PERSON))
    rows = [mx.random.normal((1, VOCAB_SIZE), key=mx.random.key(i)) for i in range(24)]
    state = SimpleNamespace(prompt=prompt, generated=[])

    whole = Samplers(tokenizer)
    whole.admit(0, request, eos, [])
    drawn = [whole.sample(0, request, state, row) for row in rows]  # type: ignore[arg-type]
    assert not eos & set(drawn)  # the schema's JSON still runs: the reply goes on past the resumption
    resumed_request = request.resume(drawn[:12])
    resumed = Samplers(tokenizer)
    resumed.admit(0, resumed_request, eos, [])
    assert [resumed.sample(0, resumed_request, state, row) for row in rows[12:]] == drawn[12:]  # type: ignore[arg-type]
