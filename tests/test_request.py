"""mlx_lm.generate's options: one typed request, the same validation everywhere, and exact tokens on real ranks.

Every option must give, on 2 ranks, exactly the tokens single-process mlx-lm gives with that
option (greedy, or seeded sampling for the sampler's options): overlapped through the engine
(``--prompts-file``, ``serve``), alone through it (``generate``, ``chat``), and through mlx-lm's
``stream_generate`` (``--pipeline native``). One ``mlx.launch`` run serves every option
(``fixtures/option_ranks.py``). The serve bodies' names are checked against a real server in
``test_serve.py``; the flags and prompts-file lines end to end below.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from fixtures.option_reference import reference as mlx_lm_reference
from fixtures.ranks import launch_cases, rank_dirs
from fixtures.tiny_models import make_tiny_checkpoint
from typer.testing import CliRunner

from mlxpipe.launch.batch import read_prompts
from mlxpipe.cli import app
from mlxpipe.errors import UsageError
from mlxpipe.prompts import prompt_tokens
from mlxpipe.request import Request, RequestError
from mlxpipe.worker.job import JobSpec

PREFILL_STEP = 8
SPLIT = [2, 4]  # rank 0 runs layers 4-5, rank 1 layers 0-3
ADAPTER_LAYERS = 4  # adapters on layers 2-5: both ranks hold some, rank 1 also two without
QUESTION = "Tell me about pipelines across several machines, please."
LONG = "Stage after stage, token by token, the hidden state moves down the ring of hosts."
_TIMEOUT = 420.0


def _chat(**options: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, **options}


def _raw(text: str = LONG, **options: Any) -> dict[str, Any]:
    return {"prompt": text, "ignore_chat_template": True, "max_tokens": 8, **options}


# One request per option (id -> Request fields), and the request without it that it must differ from.
OPTIONS: dict[str, dict[str, Any]] = {
    "top_k": _chat(temp=1.0, top_k=2, seed=1),
    "xtc": _chat(temp=1.0, xtc_probability=1.0, xtc_threshold=0.01, seed=2),
    "min_p": _raw(temp=2.0, min_p=0.2, min_tokens_to_keep=3, top_p=0.9, seed=3),
    "logit_bias": _chat(logit_bias={101: 3.0, 116: 2.0}),
    "repetition": _chat(repetition_penalty=3.0, repetition_context_size=20),  # its greedy reply repeats a token
    "presence_frequency": _chat(presence_penalty=5.0, frequency_penalty=2.0),
    "extra_eos": _chat(extra_eos_token=["<|endoftext|>"]),  # and the third greedy token's id: see _requests
    "max_kv_size": _raw(max_kv_size=12, max_tokens=10),
    "kv_bits": _raw(kv_bits=4, kv_group_size=32, quantized_kv_start=10, max_tokens=10),
    "prefill_response": _chat(prefill_response="Pipelines are"),
    "chat_template_config": _chat(chat_template_config={"add_generation_prompt_extra": True}, system_prompt="Be brief."),
}
ADAPTER_REQUESTS: dict[str, dict[str, Any]] = {"adapter_chat": _chat(), "adapter_raw": _raw()}
# Options that need not change the tokens of this tiny model (they are exercised all the same).
UNCHANGED = {"chat_template_config"}


# ---------------------------------------------------------------- the typed request


def test_a_request_survives_the_wire() -> None:
    request = Request(prompt="x", id="a", temp=0.5, seed=3, logit_bias={7: -1.5}, extra_eos_token=("<eos>", "12"),
                      kv_bits=4, chat_template_config={"enable_thinking": False})
    wire = json.loads(json.dumps(request.to_wire()))  # as the ranks read it
    assert Request.from_wire({"type": "submit", **wire}) == request
    assert Request().to_wire() == {}  # defaults are not sent


def test_a_worker_refuses_a_field_it_does_not_know() -> None:
    with pytest.raises(UsageError, match="fields this worker does not know: top_z"):
        Request.from_wire({"prompt": "x", "top_z": 3})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_k", -1, "'top_k' must be >= 0 (0: off), got -1"),
        ("xtc_probability", 1.5, "'xtc_probability' must be in [0, 1], got 1.5"),
        ("xtc_threshold", 0.6, "'xtc_threshold' must be in [0, 0.5], got 0.6"),
        ("min_tokens_to_keep", 0, "'min_tokens_to_keep' must be at least 1, got 0"),
        ("repetition_penalty", -1.0, "'repetition_penalty' must be >= 0, got -1"),
        ("max_kv_size", 0, "'max_kv_size' must be at least 1, got 0"),
        ("kv_bits", 7, "'kv_bits' must be one of 2, 3, 4, 5, 6, 8, got 7"),
        ("kv_group_size", 48, "'kv_group_size' must be one of 32, 64, 128, got 48"),
        ("quantized_kv_start", -1, "'quantized_kv_start' must be >= 0, got -1"),
    ],
)
def test_each_range_is_checked_once_for_every_caller(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as info:
        Request(**{field: value}).check()
    assert str(info.value) == message and info.value.field == field


@pytest.mark.parametrize(
    "field, value, message",
    [
        # Integers beyond what the ranks represent, floats that are not finite or absurd: every field has a range.
        ("presence_penalty", 2**70, "'presence_penalty' must be at most 100, got 1180591620717411303424"),
        ("repetition_penalty", 2**70, "'repetition_penalty' must be at most 100, got 1180591620717411303424"),
        ("frequency_penalty", -101, "'frequency_penalty' must be >= -100, got -101"),
        ("temp", 2**70, "'temp' must be at most 100, got 1180591620717411303424"),
        ("temp", float("nan"), "'temp' must be a finite number, got nan"),
        ("top_p", float("inf"), "'top_p' must be a finite number, got inf"),
        ("temp", "hot", "'temp' must be a finite number, got 'hot'"),
        ("temp", 10**400, "'temp' must be a finite number, got 100000... (401 digits)"),
        ("seed", -1, "'seed' must be >= 0, got -1"),
        ("seed", 2**64, "'seed' must be at most 18446744073709551615, got 18446744073709551616"),
        ("max_tokens", 2**31, "'max_tokens' must be at most 2147483647, got 2147483648"),
        ("max_tokens", True, "'max_tokens' must be an integer, got True"),
        ("top_k", 1.5, "'top_k' must be an integer, got 1.5"),
        ("repetition_context_size", 10**40, "'repetition_context_size' must be at most 2147483647, got 100000... "
                                            "(41 digits)"),
        ("extra_eos_token", tuple(str(i) for i in range(17)), "'extra_eos_token' takes at most 16 tokens"),
    ],
)
def test_every_number_is_checked_for_range_not_only_type(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as info:
        Request(**{field: value}).check()
    assert str(info.value).startswith(message) and info.value.field == field


@pytest.mark.parametrize(
    "bias, message",
    [
        ({128: 1.0}, "'logit_bias' must map token ids (integers 0 to 127) to numbers, got the key 128"),
        ({-1: 1.0}, "'logit_bias' must map token ids (integers 0 to 127) to numbers, got the key -1"),
        ({5: 101.0}, "'logit_bias'[5] must be a number between -100 and 100, got 101"),
        ({5: float("nan")}, "'logit_bias'[5] must be a number between -100 and 100, got nan"),
        ({5: "high"}, "'logit_bias'[5] must be a number between -100 and 100, got 'high'"),
        ({i: 1.0 for i in range(1025)}, "'logit_bias' must map at most 1024 token ids to biases"),
    ],
)
def test_logit_bias_names_only_tokens_the_model_has(bias: dict[Any, Any], message: str) -> None:
    # A bias beyond the vocabulary crashes mlx's indexing (a segmentation fault, not an exception).
    with pytest.raises(RequestError) as info:
        Request(logit_bias=bias).check(vocab_size=128)
    assert str(info.value) == message


def test_checked_numbers_reach_mlx_lm_as_the_types_it_takes() -> None:
    import mlx.core as mx

    from mlxpipe.worker.sampling import logits_processors

    # A JSON integer for a float option used to reach mlx-lm's processor as a Python int (std::bad_cast).
    request = Request(temp=1, presence_penalty=2, frequency_penalty=1, logit_bias={3: 2}, seed=5).check()
    assert [type(v) for v in (request.temp, request.presence_penalty, request.frequency_penalty)] == [float] * 3
    assert request.logit_bias == {3: 2.0} and type(request.seed) is int
    logits = mx.zeros((1, 8))
    for processor in logits_processors(request):
        logits = processor(mx.array([1, 2, 3]), logits)
    mx.eval(logits)
    assert logits[0, 3].item() == 2.0 - 2.0 - 1.0  # its bias, less the presence and the frequency (seen once) penalties


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-k", "-2"], "error: --top-k must be >= 0 (0: off), got -2"),
        (["--xtc-threshold", "0.9"], "error: --xtc-threshold must be in [0, 0.5], got 0.9"),
        (["--kv-bits", "7"], "error: --kv-bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
        (["--kv-group-size", "16"], "error: --kv-group-size must be one of 32, 64, 128, got 16"),
        (["--max-kv-size", "0"], "error: --max-kv-size must be at least 1, got 0"),
        (["--chat-template-config", "{nope"], "error: --chat-template-config is not valid JSON"),
        (["--chat-template-config", "[1]"], "error: --chat-template-config must be a JSON object"),
        (["--context", "0"], "error: --context must be at least 1, got 0"),
        (["--adapter-path", "/nonexistent"], "error: --adapter-path /nonexistent: no adapter_config.json or "
                                              "adapters.safetensors there"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith(message), result.output


def test_context_reaches_the_fit_check_before_anything_starts(tiny_models, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model", str(tiny_models["llama"]),
                                      "--context", "100000000"])
    assert result.exit_code == 1, result.output
    assert "at --context 100000000" in result.output


def test_prompts_file_lines_take_every_option_by_its_name(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": key, **request} for key, request in OPTIONS.items()]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    requests = read_prompts(path, Request(max_tokens=3))
    assert [r.id for r in requests] == list(OPTIONS)
    assert requests[1].xtc_probability == 1.0 and requests[3].logit_bias == {101: 3.0, 116: 2.0}
    assert requests[6].extra_eos_token == ("<|endoftext|>",) and requests[8].kv_bits == 4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"top_k": -1}, ":1: 'top_k' must be >= 0"),
        ({"top_k": 1.5}, ":1: 'top_k' must be int, got 1.5"),
        ({"logit_bias": {"x": 1}}, ":1: 'logit_bias' must be an object of token ids"),
        ({"extra_eos_token": [1]}, ":1: 'extra_eos_token' must be a string or a list of strings"),
        ({"kv_bits": 9}, ":1: 'kv_bits' must be one of 2, 3, 4, 5, 6, 8, got 9"),
        ({"chat_template_config": "x"}, ":1: 'chat_template_config' must be dict"),
    ],
)
def test_a_bad_option_on_a_line_names_the_line(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", **options}) + "\n")
    with pytest.raises(UsageError) as info:
        read_prompts(path, Request())
    assert f"{path}{message}" in str(info.value)


def test_interleaved_requests_each_sample_what_they_sample_alone() -> None:
    """mlx-lm's own sampler, each request on its own key: as alone after ``mx.random.seed(seed)``."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxpipe.worker.sampling import KeyedSampler

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


# ---------------------------------------------------------------- prompts, as mlx_lm.generate makes them


def _template_tokenizer(path: Path) -> Any:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}{% if shout %}!{% endif %}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    return tokenizer


def test_template_options_make_the_prompt_mlx_lm_generate_makes(tiny_models) -> None:
    tokenizer = _template_tokenizer(tiny_models["llama"])
    request = Request(prompt="Hi", system_prompt="Be kind.", prefill_response="Sure,",
                      chat_template_config={"shout": True})
    # mlx_lm.generate's main(), for the same flags.
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Sure,"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                         add_generation_prompt=False, shout=True)
    assert text.startswith("[system!]Be kind.[user!]Hi[assistant!]Sure,")
    assert prompt_tokens(tokenizer, request) == tokenizer.encode(text, add_special_tokens=False)


def test_use_default_chat_template_changes_nothing_where_transformers_has_no_default(tiny_models) -> None:
    tokenizer = _template_tokenizer(tiny_models["llama"])
    plain = Request(prompt="Hi")
    assert prompt_tokens(tokenizer, replace(plain, use_default_chat_template=True)) == prompt_tokens(tokenizer, plain)


# ---------------------------------------------------------------- adapters on a rank's layers only


def test_a_rank_loads_only_its_own_layers_adapters(option_model: tuple[Path, Path], tmp_path: Path) -> None:
    """Rank 0's share with an adapter file holding no other rank's tensors: same weights as mlx-lm's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from mlxpipe.worker.load import load_local_adapters
    from mlxpipe.worker.pipeline.cut import pipeline_generic

    checkpoint, adapters = option_model
    own = tmp_path / "rank0-adapters"
    own.mkdir()
    (own / "adapter_config.json").write_text((adapters / "adapter_config.json").read_text())
    weights = mx.load(str(adapters / "adapters.safetensors"))
    mx.save_safetensors(str(own / "adapters.safetensors"),
                        {k: v for k, v in weights.items() if ".layers.4." in k or ".layers.5." in k})

    class Rank0:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    model, _ = load(str(checkpoint))
    start, end = pipeline_generic(model, Rank0(), SPLIT)
    load_local_adapters(model, own, start, end, 0)
    reference, _ = load(str(checkpoint), adapter_path=str(adapters))
    mine = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(reference.parameters()))
    local = [k for k in theirs if ".layers.4." in k or ".layers.5." in k]
    assert any(k.endswith("lora_b") for k in local)
    for k in local:
        assert mx.array_equal(mine[k], theirs[k]), k
    assert not any(".layers.1." in k and "lora" in k for k in mine)  # a stand-in: nothing to adapt


# ---------------------------------------------------------------- every option on real ranks


@pytest.fixture(scope="module")
def option_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny qwen2 whose head_dim (32) KV quantization takes, and random LoRA adapters on its last 4 layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    root = tmp_path_factory.mktemp("options")
    # qwen2: mlx-lm's make_prompt_cache honours max_kv_size only for models without their own make_cache.
    checkpoint = make_tiny_checkpoint("qwen2", root / "qwen2", overrides={"hidden_size": 128})
    model, _ = load(str(checkpoint))
    lora = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, ADAPTER_LAYERS, lora)
    adapters = {k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.2
                for i, (k, v) in enumerate(tree_flatten(model.parameters())) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    dest = root / "adapters"
    dest.mkdir()
    mx.save_safetensors(str(dest / "adapters.safetensors"), adapters)
    (dest / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": ADAPTER_LAYERS, "lora_parameters": lora}))
    return checkpoint, dest


def reference(path: Path, fields: dict[str, Any], adapters: Path | None = None) -> list[int]:
    return mlx_lm_reference(path, fields, adapters, prefill_step_size=PREFILL_STEP)[0]


def _without(fields: dict[str, Any]) -> dict[str, Any]:
    """The same request with mlxpipe's defaults for every option but the prompt, length, temperature and seed."""
    keep = {"messages", "prompt", "ignore_chat_template", "max_tokens", "temp", "seed"}
    return {k: v for k, v in fields.items() if k in keep}


def _requests(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """``OPTIONS`` with the extra EOS made one the greedy reply meets (its third token), and the logit
    bias banning its first."""
    requests = {key: {"id": key, **fields} for key, fields in OPTIONS.items()}
    third = reference(checkpoint, _without(OPTIONS["extra_eos"]))[2]
    requests["extra_eos"]["extra_eos_token"] = ["<|endoftext|>", str(third)]
    first = reference(checkpoint, _without(OPTIONS["logit_bias"]))[0]
    requests["logit_bias"]["logit_bias"] = {first: -100.0, 116: 2.0}
    return requests


@pytest.fixture(scope="module")
def option_runs(option_model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checkpoint, adapters = option_model
    tmp = tmp_path_factory.mktemp("option-runs")
    dirs = [str(d) for d in rank_dirs(checkpoint, SPLIT, tmp / "dirs")]
    requests = list(_requests(checkpoint).values())
    cases = [
        {"id": "options", "job": asdict(JobSpec(dirs, SPLIT, prefill_step_size=PREFILL_STEP)),
         "requests": requests, "concurrency": 3},
        {"id": "native", "job": asdict(JobSpec(dirs, SPLIT, mode="native", prefill_step_size=PREFILL_STEP)),
         "requests": requests},
        {"id": "adapters", "job": asdict(JobSpec(dirs, SPLIT, prefill_step_size=PREFILL_STEP,
                                                 adapter_path=str(adapters))),
         "requests": [{"id": key, **fields} for key, fields in ADAPTER_REQUESTS.items()], "concurrency": 2},
    ]
    result = launch_cases("option_ranks.py", cases, 2, tmp, timeout=_TIMEOUT)
    by_case = {(e["id"], e["rank"]): e for e in result.of("options_case")}
    if len(by_case) != 2 * len(cases):
        pytest.fail(f"not every case came back from every rank\n{result.describe()}")
    return {"cases": {c["id"]: c for c in cases}, "events": by_case}


@pytest.mark.ranks
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_is_token_identical_to_mlx_lm(option_runs, option_model, option: str) -> None:
    checkpoint, _ = option_model
    request = next(r for r in option_runs["cases"]["options"]["requests"] if r["id"] == option)
    fields = {k: v for k, v in request.items() if k != "id"}
    expected = reference(checkpoint, fields)
    event = option_runs["events"][("options", 0)]
    assert event["engine"][option]["tokens"] == expected, "overlapped (--prompts-file, serve)"
    assert event["alone"][option]["tokens"] == expected, "alone (generate, chat)"
    assert option_runs["events"][("native", 0)]["alone"][option]["tokens"] == expected, "stream_generate (native)"
    if option not in UNCHANGED:
        assert expected != reference(checkpoint, _without(fields)), "the option changes nothing: a weak test"
    if option == "extra_eos":
        assert len(expected) <= 3


@pytest.mark.ranks
@pytest.mark.parametrize("request_id", list(ADAPTER_REQUESTS))
def test_adapters_give_mlx_lms_tokens(option_runs, option_model, request_id: str) -> None:
    checkpoint, adapters = option_model
    fields = ADAPTER_REQUESTS[request_id]
    expected = reference(checkpoint, fields, adapters)
    event = option_runs["events"][("adapters", 0)]
    assert event["engine"][request_id]["tokens"] == expected
    assert event["alone"][request_id]["tokens"] == expected
    assert expected != reference(checkpoint, fields), "the adapters change nothing: a weak test"


# ---------------------------------------------------------------- the command line, end to end


@pytest.mark.ranks
def test_flags_and_prompts_file_lines_reach_the_ranks(option_model: tuple[Path, Path], tmp_path: Path) -> None:
    """``generate --prompts-file`` with option flags (the lines' defaults) and a line overriding them, adapters on."""
    import subprocess
    import sys

    checkpoint, adapters = option_model
    flags = {"temp": 1.0, "top_k": 2, "seed": 4, "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 10}
    lines = [_raw(max_tokens=6), _chat(max_tokens=6, temp=0.0, top_k=0, prefill_response="Sure")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = [str(Path(sys.executable).parent / "mlxpipe"), "generate", "--model", str(checkpoint), "--prompts-file",
            str(path), "--adapter-path", str(adapters), "--json", "--prefill-step-size", str(PREFILL_STEP)]
    for key, value in flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    got = [r["tokens"] for r in json.loads(result.stdout)["results"]]
    expected = [reference(checkpoint, {**flags, **line}, adapters)
                for line in lines]
    assert got == expected
