"""Tensor parallelism (``--tp``) gives exactly mlx-lm's tokens, on real ranks.

Greedy generation over a tensor-parallel group must be token-identical to
single-process ``mlx_lm.stream_generate``: pure tensor parallelism on 2 ranks
(``--tp 2``), for architectures with their own ``shard()`` (llama, qwen2 with a
tied head) and without (phi3: fused ``qkv_proj`` and ``gate_up_proj``;
starcoder2: biases, ``c_fc``/``c_proj``), and tensor x pipeline on 4 ranks
(2 stages x ``--tp 2``), overlapped and batched decode included. Quantized
checkpoints (4-bit, as mlx-community's; float32 scales) too: their quantized
head and embedding are split by vocabulary like plain ones (llama's own head,
qwen2's tied one). And speculative decoding (``--draft-model``) on a group,
pure and hybrid: greedy, it gives plain greedy's tokens; seeded sampling,
mlx-lm's speculative ones. One ``mlx.launch`` run per rank count serves every
case (``fixtures/tp_ranks.py``).

The sliced layers add their partial sums in another order than one process
does, so logits differ in the last bits; they are checked within
``LOGITS_TOLERANCE`` of mlx-lm's. Token identity is asserted everywhere: a
near-tie flipped by such a difference would show as a failing case here, to be
shown with its logits, never by loosening the check.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from fixtures import arch_suite
from fixtures.draft_models import first_layers_draft
from fixtures.option_reference import reference as mlx_lm_reference
from fixtures.pipeline_reference import CHAT, MAX_TOKENS, PREFILL_STEP, QUESTION, SAMPLED, reference_tokens
from fixtures.pipeline_reference import request_reference as _reference
from fixtures.ranks import LaunchResult, launch_cases, rank_dirs
from fixtures.tiny_models import TinyModels
from mlxpipe.protocol.job import JobSpec

LOGITS_TOLERANCE = 1e-4  # float32 sums of a few hundred terms, reordered
# A few tokens through every layer of a case is the same check as more; the drafts' cases keep MAX_TOKENS, enough
# for drafts both accepted and rejected.
SHORT = 4
OTHER_PROMPT = [{"prompt": "Why split attention by heads?"}]
DRAFT_SAMPLED = [{"messages": [{"role": "user", "content": QUESTION}], "temp": 0.9, "top_p": 0.95, "seed": 11}]

# Pure tensor parallelism on 2 ranks: one stage of all 6 layers.
CASES_2: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "split": [6], "max_tokens": SHORT, "turns": CHAT + OTHER_PROMPT},
    "qwen2": {"arch": "qwen2", "split": [6], "max_tokens": SHORT, "turns": CHAT + OTHER_PROMPT},
    "phi3": {"arch": "phi3", "split": [6], "max_tokens": SHORT, "turns": CHAT + OTHER_PROMPT},
    "starcoder2": {"arch": "starcoder2", "split": [6], "max_tokens": SHORT, "turns": CHAT[:1] + OTHER_PROMPT},
    "qwen2-sampled": {"arch": "qwen2", "split": [6], "max_tokens": SHORT, "turns": SAMPLED},
    "phi3-logits": {"arch": "phi3", "split": [6], "logits": True},
    "llama-logits": {"arch": "llama", "split": [6], "logits": True},
    # Quantized (4-bit): qwen2's tied QuantizedEmbedding head, llama's QuantizedLinear head.
    "qwen2-4bit": {"arch": "qwen2-4bit", "split": [6], "max_tokens": SHORT, "turns": CHAT},
    "llama-4bit-logits": {"arch": "llama-4bit", "split": [6], "logits": True},
    # Speculative decoding: a draft of the target's first layers, whole on every member.
    "qwen2-draft": {"arch": "qwen2", "split": [6], "turns": CHAT, "draft": True},
}
# Tensor x pipeline on 4 ranks: 2 stages of a 2-rank group each. Slow on 2 cores: few prompts.
BATCH_REQUESTS = [
    {"id": i, "prompt": p, "max_tokens": 6}
    for i, p in enumerate([QUESTION, "Why split attention by heads?", "Short one."])
]
CASES_4: dict[str, dict[str, Any]] = {
    "llama-3-3": {"arch": "llama", "split": [3, 3], "max_tokens": SHORT, "turns": CHAT[:1]},
    "phi3-2-4": {"arch": "phi3", "split": [2, 4], "max_tokens": SHORT, "turns": OTHER_PROMPT},
    "llama-4bit-3-3": {"arch": "llama-4bit", "split": [3, 3], "max_tokens": SHORT, "turns": OTHER_PROMPT},
    "qwen2-draft-3-3": {"arch": "qwen2", "split": [3, 3], "turns": CHAT, "draft": True},
    # Seeded speculative sampling: every stage computes the logits it samples from (see worker/tensor/vocab.py).
    "qwen2-draft-sampled-3-3": {"arch": "qwen2", "split": [3, 3], "turns": DRAFT_SAMPLED, "draft": True},
    # Overlapped, batched decode on tensor-parallel stages (it once hung: a member's receive run
    # before its own send by MLX's lazy evaluation; see worker/groups.py).
    "qwen2-batched": {"arch": "qwen2", "split": [3, 3], "requests": BATCH_REQUESTS, "concurrency": [[3, 2]]},
    # The generic sharder's MoE block (routed experts, a gated shared expert) summed by each stage's own
    # all-reduce: the architecture suite's tiny qwen2_moe (4 layers).
    "qwen2_moe-2-2": {"arch": "qwen2_moe-suite", "split": [2, 2], "max_tokens": SHORT, "turns": OTHER_PROMPT},
    # Norms over all heads (one more group sum per layer) and an MoE block, on 2 stages.
    "olmoe-1-3": {"arch": "olmoe-suite", "split": [1, 3], "max_tokens": SHORT, "turns": OTHER_PROMPT},
}


def _ahead_requests(checkpoint: Path, lengths: tuple[int, int, int] = (8, 5, 7)) -> list[dict[str, Any]]:
    """Greedy requests of several lengths, one ending on an end-of-sequence token (its third greedy token):
    the decode step run ahead of it is taken back (see worker/generation/ahead.py)."""
    from fixtures.option_reference import reference

    prompts = [QUESTION, "Why split attention by heads?", "Short one."]
    requests = [{"id": i, "messages": [{"role": "user", "content": p}], "max_tokens": n}
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    third = reference(checkpoint, {k: v for k, v in requests[0].items() if k != "id"})[0][2]
    requests[0]["extra_eos_token"] = [str(third)]
    return requests


# Pure tensor parallelism decodes a step ahead (worker/generation/ahead.py): one request at a time, and one group of 3.
CASES_2["qwen2-ahead-k1"] = {"arch": "qwen2", "split": [6], "requests": _ahead_requests, "concurrency": [1]}
# The short prompts decode while the long one prefills: long enough replies for a group of all three.
CASES_2["qwen2-ahead-k3"] = {"arch": "qwen2", "split": [6], "requests": lambda c: _ahead_requests(c, (8, 14, 12)),
                            "concurrency": [[3, 3]]}
CASES = {2: CASES_2, 4: CASES_4}
TP = 2
_TIMEOUT = {2: 300.0, 4: 400.0}

pytestmark = pytest.mark.ranks


def _prompt_ids(checkpoint: Path) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _job(case: dict[str, Any], checkpoints: Checkpoints, tmp: Path) -> JobSpec:
    """Each member of a stage's group gets its stage's files; with a draft, every rank the whole draft."""
    dirs = rank_dirs(checkpoints[case["arch"]], case["split"], tmp)
    paths = [str(d) for d in dirs for _ in range(TP)]
    draft = [str(checkpoints.draft(case["arch"]))] * len(paths) if case.get("draft") else None
    return JobSpec(paths, case["split"], prefill_step_size=PREFILL_STEP, tp=TP, draft_paths=draft)


class Checkpoints:
    """The tiny checkpoints of the cases: ``arch``, ``arch-4bit`` (mlx-lm's 4-bit conversion, group size 32,
    float32 scales), ``arch-suite`` (the architecture suite's, 4 layers, for architectures ``tiny_models``
    lacks), and ``draft(arch)``: the first layers of ``arch``."""

    def __init__(self, tiny_models: TinyModels, root: Path) -> None:
        self.tiny_models, self.root = tiny_models, root

    def __getitem__(self, name: str) -> Path:
        if name.endswith("-suite"):
            return arch_suite.build(name.removesuffix("-suite"), self.root)
        if not name.endswith("-4bit"):
            return self.tiny_models[name]
        dest = self.root / name
        if not dest.exists():
            from mlx_lm.convert import convert

            convert(str(self.tiny_models[name.removesuffix("-4bit")]), str(dest), quantize=True, q_group_size=32,
                    q_bits=4, dtype="float32")
        return dest

    def draft(self, name: str) -> Path:
        dest = self.root / f"{name}-draft"
        return dest if dest.exists() else first_layers_draft(self[name], dest)


@pytest.fixture(scope="session")
def checkpoints(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tiny_models, tmp_path_factory.mktemp("tp_checkpoints"))


@pytest.fixture(scope="session")
def tp_results(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """rank count -> (the driver run over all its cases, {(case, rank): event}), launched on first use."""
    runs: dict[int, tuple[LaunchResult, dict[tuple[str, int], dict[str, Any]]]] = {}

    def get(num_ranks: int):
        if num_ranks not in runs:
            tmp = tmp_path_factory.mktemp(f"tp{num_ranks}")
            cases = []
            for case_id, case in CASES[num_ranks].items():
                checkpoint = checkpoints[case["arch"]]
                spec = {"id": case_id, "job": asdict(_job(case, checkpoints, tmp / case_id))}
                if case.get("logits"):
                    spec["logits"] = _prompt_ids(checkpoint)
                elif "requests" in case:
                    requests = case["requests"]
                    spec.update(requests=requests(checkpoint) if callable(requests) else requests,
                                concurrency=case["concurrency"])
                else:
                    spec["turns"] = [{"type": "generate", "max_tokens": case.get("max_tokens", MAX_TOKENS),
                                      "keep_cache": True, **t} for t in case["turns"]]
                cases.append(spec)
            result = launch_cases("tp_ranks.py", cases, num_ranks, tmp, timeout=_TIMEOUT[num_ranks])
            by_case = {(e["id"], e["rank"]): e for e in result.events
                       if e.get("event") in ("case", "logits", "batch_run")}
            runs[num_ranks] = (result, by_case)
        return runs[num_ranks]

    return get


def _events(tp_results, num_ranks: int, case_id: str) -> list[dict[str, Any]]:
    result, by_case = tp_results(num_ranks)
    events = [by_case.get((case_id, r)) for r in range(num_ranks)]
    if any(e is None for e in events):
        pytest.fail(f"no result for {case_id} from every rank\n{result.describe()}")
    return events  # type: ignore[return-value]


def _check_turns(tp_results, checkpoints: Checkpoints, num_ranks: int, case_id: str) -> None:
    case = CASES[num_ranks][case_id]
    events = _events(tp_results, num_ranks, case_id)
    tokens = [[t["tokens"] for t in e["turns"]] for e in events]
    assert all(t == tokens[0] for t in tokens), f"ranks disagree: {tokens}"
    # Greedy speculative decoding gives plain greedy decoding's tokens.
    assert tokens[0] == reference_tokens(checkpoints[case["arch"]], case["turns"], case.get("max_tokens", MAX_TOKENS))
    # Every member of stage s runs the stage's layers.
    for rank, event in enumerate(events):
        stage = rank // TP
        start = sum(case["split"][stage + 1 :])
        assert event["layers"] == [start, start + case["split"][stage]]


TURN_CASES_2 = [c for c, case in CASES_2.items() if "turns" in case and not case.get("draft")]


@pytest.mark.parametrize("case_id", TURN_CASES_2)
def test_tp2_on_two_ranks_matches_mlx_lm(tp_results, checkpoints, case_id: str) -> None:
    _check_turns(tp_results, checkpoints, 2, case_id)


@pytest.mark.parametrize("arch, sharding", [("phi3", "generic"), ("llama", "own shard()"),
                                            ("llama-4bit", "own shard()")])
def test_tp2_members_hold_half_the_weights_and_mlx_lms_logits(tp_results, checkpoints, arch: str,
                                                              sharding: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    events = _events(tp_results, 2, f"{arch}-logits")
    assert events[0]["logits"] == events[1]["logits"], "the members hold different logits"
    model, _ = load(str(checkpoints[arch]))
    expected = model(mx.array([_prompt_ids(checkpoints[arch])]))[0, -1]
    got = mx.array(events[0]["logits"])
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() <= LOGITS_TOLERANCE
    whole = sum(p.size for _, p in tree_flatten(model.parameters()))
    for event in events:
        assert event["sharding"] == sharding
        # Layers, embedding and head are split; only norms (and row-parallel biases) stay whole.
        assert whole / 2 <= event["parameters"] < whole / 2 * 1.02


@pytest.mark.parametrize("case_id", ["llama-3-3", "phi3-2-4", "llama-4bit-3-3", "qwen2_moe-2-2", "olmoe-1-3"])
def test_tp2_times_two_stages_on_four_ranks_matches_mlx_lm(tp_results, checkpoints, case_id: str) -> None:
    _check_turns(tp_results, checkpoints, 4, case_id)


@pytest.mark.parametrize("num_ranks, case_id", [(2, "qwen2-draft"), (4, "qwen2-draft-3-3")])
def test_speculative_decoding_on_tp_groups_gives_greedy_tokens(tp_results, checkpoints, num_ranks: int,
                                                                case_id: str) -> None:
    """``--draft-model`` with ``--tp``: every rank drafts with its whole draft, the group verifies; some
    drafts accepted, some rejected (caches trimmed; the second chat turn reuses them)."""
    _check_turns(tp_results, checkpoints, num_ranks, case_id)
    turns = _events(tp_results, num_ranks, case_id)[0]["turns"]
    drafted = sum(t["draft_tokens"] for t in turns)
    assert 0 < drafted < sum(len(t["tokens"]) for t in turns)
    if len(turns) > 1:
        assert turns[1]["cached_tokens"] > 0


def test_seeded_speculative_sampling_on_tp_stages_gives_mlx_lms_tokens(tp_results, checkpoints) -> None:
    """Sampled, the draft shows (speculative sampling draws other tokens than plain sampling); every rank of
    both stages draws mlx-lm's."""
    events = _events(tp_results, 4, "qwen2-draft-sampled-3-3")
    got = [e["turns"][0]["tokens"] for e in events]
    fields = {**DRAFT_SAMPLED[0], "max_tokens": MAX_TOKENS}
    expected = mlx_lm_reference(checkpoints["qwen2"], fields, prefill_step_size=PREFILL_STEP,
                                draft=checkpoints.draft("qwen2"))[0]
    assert got == [expected] * 4
    assert expected != mlx_lm_reference(checkpoints["qwen2"], fields, prefill_step_size=PREFILL_STEP)[0]


def test_overlapped_batched_decode_on_tp_stages_matches_mlx_lm(tp_results, tiny_models) -> None:
    events = _events(tp_results, 4, "qwen2-batched")
    results = {e["id"]: e for e in events[0]["events"] if e["event"] == "result"}
    path = str(tiny_models["qwen2"])
    for request in BATCH_REQUESTS:
        tokens, _ = _reference(path, json.dumps(request, sort_keys=True))
        assert results[request["id"]]["tokens"] == tokens, request["id"]
    dones = [next(x for x in e["events"] if x["event"] == "batch_done") for e in events]
    assert len({(d["ticks"], d["generation_tokens"]) for d in dones}) == 1, "ranks disagree on the schedule"
    assert dones[0]["decode_batch"] == 2


@pytest.mark.parametrize("case_id", ["qwen2-ahead-k1", "qwen2-ahead-k3"])
def test_decode_run_ahead_on_one_stage_matches_mlx_lm(tp_results, tiny_models, case_id: str) -> None:
    from fixtures.option_reference import reference

    checkpoint = tiny_models["qwen2"]
    events = _events(tp_results, 2, case_id)
    results = {e["id"]: e for e in events[0]["events"] if e["event"] == "result"}
    for request in CASES_2[case_id]["requests"](checkpoint):
        expected, _ = reference(checkpoint, {k: v for k, v in request.items() if k != "id"})
        assert results[request["id"]]["tokens"] == expected, request["id"]
    assert len(results[0]["tokens"]) == 3, "the end-of-sequence token did not end the first request"
    dones = [next(x for x in e["events"] if x["event"] == "batch_done") for e in events]
    assert dones[0]["run_ahead"] == dones[1]["run_ahead"], "the members ran different steps ahead"
    # Every decode step but the first of a group is run ahead; the one after the end-of-sequence is undone.
    assert dones[0]["run_ahead"]["used"] > 0 and dones[0]["run_ahead"]["taken_back"] >= 1


# --- mlxpipe serve --tp 2: the per-tick agreement on messages, lazily (worker/generation/ahead.py) -------------


@pytest.fixture(scope="module")
def tp_server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory):
    """``mlxpipe serve`` of the tiny qwen2 at ``--tp 2`` on 2 local ranks, for this module."""
    from fixtures.serve_process import ready_server

    with ready_server(["--model", str(tiny_models["qwen2"]), "--hostfile", "hostfiles/local-2.json", "--tp", "2",
                       "--max-concurrency", "3", "--decode-batch", "3"], tmp_path_factory.mktemp("tp-serve")) as proc:
        yield proc


def _chat(tp_server: Any, messages: list[dict[str, str]], max_tokens: int = 12, stream: bool = False) -> str:
    import openai

    client = openai.OpenAI(base_url=tp_server.url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_serve_with_tp_gives_mlx_lms_replies_alone_together_and_after_a_cancel(tp_server, tiny_models) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from fixtures.option_reference import reference

    checkpoint = tiny_models["qwen2"]
    questions = [QUESTION, "Why split attention by heads?", "Short one."]

    def expected(messages: list[dict[str, str]], n: int = 12) -> str:
        return reference(checkpoint, {"messages": messages, "max_tokens": n})[1]

    first = [{"role": "user", "content": questions[0]}]
    assert _chat(tp_server, first) == expected(first)
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda q: _chat(tp_server, [{"role": "user", "content": q}], stream=True), questions))
    assert together == [expected([{"role": "user", "content": q}]) for q in questions]
    # A stream dropped after its first chunk: its cancel reaches the ranks while a step runs ahead.
    body = {"model": "m", "messages": [{"role": "user", "content": "A long one, please."}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tp_server.url}/chat/completions", json=body, timeout=120) as response:
        next(response.iter_lines())
    history = [*first, {"role": "assistant", "content": _chat(tp_server, first)},
               {"role": "user", "content": "And then?"}]
    assert _chat(tp_server, history) == expected(history)  # the prompt cache holds what the first turn fed
