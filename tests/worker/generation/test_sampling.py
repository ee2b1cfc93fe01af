"""worker/generation/sampling.py: mlx-lm's samplers, each request on its own random key."""

from __future__ import annotations


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
