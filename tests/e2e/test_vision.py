"""Images in: ``mlxpipe generate --image`` on real ranks gives single-process mlx-vlm's greedy tokens.

The vision tower and projector run on the first stage (the highest rank); Qwen2.5-VL's multi-axis rotary
positions travel with the hidden state to the other stage. Tiny random checkpoints of the families
(``fixtures/vision_models.py``); the reference is ``mlx_vlm.stream_generate`` in this process.

Starting ranks is the slow part, so one launch per rank count serves every family and layout of it
(``fixtures/vision_suite.py``): each case's job and ``generate`` message are built here as ``generate --image``
builds them (the planner's split, the picture tokenized by the controller's processor) and run by
``fixtures/vision_ranks.py`` with the worker's own code. One real ``generate --image`` run, one ``chat --image``
run and the served model keep the controller's path tested end to end.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image as Pil

from fixtures.browser import open_page as _open
from fixtures.browser import until as _until
from fixtures.processes import local_rank_processes
from fixtures.schemas import SCHEMAS
from fixtures.serve_process import ServeProcess, ready_server
from fixtures.vision_models import VisionModels
from fixtures.vision_models import test_image as picture_bytes
from fixtures.vision_suite import Case, Run, cli_case, local_hostfile, run_in_one_launch
from mlxpipe.vision.families import RUNS

REPO = Path(__file__).resolve().parents[2]
MLXPIPE = str(Path(sys.executable).parent / "mlxpipe")
TIMEOUT = 180
PROMPT = "Describe this."
MAX_TOKENS = 6  # a few tokens through every layer: the same check as more, in half the decode steps
TOOL_TOKENS = 160  # one call of the byte tokenizer is ~40-90 tokens; the bounded schemas end it
# The families the table says run (mlxpipe/vision/families.py): each at 2 ranks.
RUNNING = sorted(RUNS)
# Both --tp layouts on the four families issue 33 names (one with multi-axis positions, one MoE), and --tp 2 on
# Qwen3-VL (its deepstack features on every member of the first stage's group).
TP_CASES = [*((f, layout) for f in ("gemma3", "kimi_vl", "mistral3", "qwen2_5_vl") for layout in ("tp2", "2x-tp2")),
            ("qwen3_vl", "tp2")]
# (ranks, --tp), one launch per rank count. "pipeline": 2 stages; "tp2": one stage of 2; "2x-tp2": 2 stages of 2.
LAYOUTS: dict[str, tuple[int, int | None]] = {"pipeline": (2, None), "tp2": (2, 2), "2x-tp2": (4, 2)}


def mlxpipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MLXPIPE, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two different small pictures."""
    root = tmp_path_factory.mktemp("images")
    paths = [root / f"picture-{seed}.png" for seed in (0, 1)]
    for seed, path in enumerate(paths):
        path.write_bytes(picture_bytes(seed))
    return paths


@pytest.fixture(scope="module")
def reference(vision_models: VisionModels, images: list[Path]) -> dict[tuple[str, int], list[int]]:
    """(family, picture) -> mlx-vlm's greedy tokens, computed once per pair on first use."""
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    cache: dict[tuple[str, int], list[int]] = {}

    class Reference(dict[tuple[str, int], list[int]]):
        def __missing__(self, key: tuple[str, int]) -> list[int]:
            family, picture = key
            if key not in cache:
                model, processor = load(str(vision_models[family]))
                prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
                responses = stream_generate(model, processor, prompt, image=[str(images[picture])],
                                            max_tokens=MAX_TOKENS, temperature=0.0)
                cache[key] = [r.token for r in responses][:MAX_TOKENS]
            return cache[key]

    return Reference()


@pytest.fixture(scope="module")
def vision_runs(vision_models: VisionModels, images: list[Path],
                tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """layout -> the one launch of its rank count, started on first use: on 2 ranks both the pipeline layout (every
    family that runs, and Qwen2.5-VL with the other picture) and --tp 2 (TP_CASES' families of it), each case's id
    ``family@layout``; on 4 ranks, 2 stages x --tp 2 of TP_CASES' families of it."""
    runs: dict[int, Run] = {}

    def get(layout: str) -> Run:
        num_ranks = LAYOUTS[layout][0]
        if num_ranks not in runs:
            tmp = tmp_path_factory.mktemp(f"vision-{num_ranks}-ranks")
            hostfile = local_hostfile(num_ranks, tmp)
            cases: list[Case] = []
            for name, (ranks, tp) in LAYOUTS.items():
                if ranks != num_ranks:
                    continue
                if name == "pipeline":
                    families = [(f, 0) for f in RUNNING] + [("qwen2_5_vl", 1)]
                else:
                    families = [(f, 0) for f, at in TP_CASES if at == name]
                cases += [cli_case(case_id(f, name, picture), vision_models[f], images[picture], hostfile, PROMPT,
                                   MAX_TOKENS, tp) for f, picture in families]
            # Measured on 2 busy CPU cores: ~8 s a case on 2 ranks, ~20 s on 4, after ~15 s of start; 3-4x that.
            runs[num_ranks] = run_in_one_launch(cases, hostfile, tmp, timeout=120 + 15 * num_ranks * len(cases))
        return runs[num_ranks]

    return get


def case_id(family: str, layout: str, picture: int = 0) -> str:
    """A case's id in its launch: the family, its layout, and the other picture's number when not the first."""
    return f"{family}@{layout}" + (f", picture {picture}" if picture else "")


def answer(run: Run, case_id: str) -> list[int]:
    """The case's tokens, once every rank gave the same ones, each rank running the layers the planner gave it, the
    first stage (every member of its group) holding the whole vision tower and the image processor, no other."""
    case = run.cases[case_id]
    found = run.events.get(case_id, [])
    if len(found) != case.job.world_size:
        pytest.fail(f"no result for {case_id} from every rank\n{run.result.describe()}")
    assert case.request.images and case.request.vision_prompt  # the picture went, with the controller's token ids
    assert [e["layers"] for e in found] == case.layers()
    first = case.first_stage()
    assert [e["vision"] for e in found] == [True] * len(found)
    assert [e["processor"] for e in found] == first
    assert [e["tower"] > 0 for e in found] == first
    assert len({e["tower"] for e, holds in zip(found, first, strict=True) if holds}) == 1
    if case.job.tp > 1:
        assert all(e["sharding"] != "none" for e in found), [e["sharding"] for e in found]
    done = [e["done"] for e in found]
    assert done[0]["finish_reason"] in ("stop", "length"), done[0].get("error")
    tokens = [d["tokens"] for d in done]
    assert all(t == tokens[0] for t in tokens), f"the ranks disagree: {tokens}"
    return list(tokens[0])


def generate(model: Path, image: Path, *flags: str) -> dict[str, Any]:
    """``mlxpipe generate --image ... --json``'s answer."""
    result = mlxpipe("generate", "--model", str(model), "--image", str(image), "--prompt", PROMPT,
                     "--max-tokens", str(MAX_TOKENS), "--json", *flags)
    assert result.returncode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


@pytest.mark.ranks
def test_generate_image_through_the_cli(vision_models: VisionModels, images: list[Path],
                                        reference: dict[tuple[str, int], list[int]], tmp_path: Path) -> None:
    """One real ``generate --image`` (the controller's processor, launch and events): mlx-vlm's tokens, each rank on
    the layers of the job the suite builds for the same command."""
    hostfile = local_hostfile(2, tmp_path)
    got = generate(vision_models["qwen2_5_vl"], images[0], "--hostfile", str(hostfile))
    assert [int(t) for t in got["tokens"]] == reference["qwen2_5_vl", 0]
    case = cli_case("qwen2_5_vl", vision_models["qwen2_5_vl"], images[0], hostfile, PROMPT, MAX_TOKENS)
    assert [[r["start"], r["end"]] for r in sorted(got["ranks"], key=lambda r: r["rank"])] == case.layers()
    assert got["prompt_tokens"] == len(case.request.tokens or [])  # the same tokens: the picture's placeholders


@pytest.mark.ranks
@pytest.mark.parametrize("family", RUNNING)
def test_two_ranks_equal_mlx_vlm(vision_runs: Callable[[str], Run], reference: dict[tuple[str, int], list[int]],
                                 family: str) -> None:
    """2 pipeline ranks: the vision tower on the first stage, the language model cut in two."""
    assert answer(vision_runs("pipeline"), case_id(family, "pipeline")) == reference[family, 0]


@pytest.mark.ranks
def test_other_image_other_tokens(vision_runs: Callable[[str], Run],
                                  reference: dict[tuple[str, int], list[int]]) -> None:
    """The picture reaches the model: another one gives mlx-vlm's other tokens."""
    tokens = answer(vision_runs("pipeline"), case_id("qwen2_5_vl", "pipeline", 1))
    assert tokens == reference["qwen2_5_vl", 1]
    assert tokens != reference["qwen2_5_vl", 0]


@pytest.mark.ranks
@pytest.mark.parametrize(("family", "layout"), TP_CASES)
def test_tensor_parallel_equal_mlx_vlm(vision_runs: Callable[[str], Run],
                                       reference: dict[tuple[str, int], list[int]], family: str, layout: str) -> None:
    """--tp 2 (one stage) and 2 stages x --tp 2: embeddings (Qwen-VL's positions, Qwen3-VL's deepstack features)
    reach every member of a group, every family's blocks split by heads (Kimi-VL's latent attention and experts
    too)."""
    assert answer(vision_runs(layout), case_id(family, layout)) == reference[family, 0]


def test_text_model_refused_before_launch(demo_model: Path, images: list[Path]) -> None:
    """An image to a text-only model: one line, and no rank started."""
    result = mlxpipe("generate", "--model", str(demo_model), "--image", str(images[0]), "--prompt", PROMPT)
    assert result.returncode != 0
    assert "is a text-only model; it takes no images" in result.stderr
    assert "starting" not in result.stderr


@pytest.mark.parametrize("model_type", ["gemma3n", "llava"])
def test_family_that_cannot_be_split_refused_before_launch(vision_models: VisionModels, images: list[Path],
                                                           tmp_path: Path, model_type: str) -> None:
    """A family the table refuses (mlxpipe/vision/families.py): one line naming its model type and the reason,
    with or without an image, and no rank started."""
    import shutil

    checkpoint = tmp_path / model_type
    shutil.copytree(vision_models["qwen2_5_vl"], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    for image in ((), ("--image", str(images[0]))):
        result = mlxpipe("generate", "--model", str(checkpoint), *image, "--prompt", PROMPT)
        assert result.returncode != 0
        assert f"{model_type}: mlxpipe cannot split this vision-language model: " in result.stderr
        assert "starting" not in result.stderr


def test_deepstack_layers_off_the_first_stage_refused_before_launch(vision_models: VisionModels,
                                                                     images: list[Path]) -> None:
    """Qwen3-VL adds deepstack features after layer 0 (the fixture's one deepstack layer): a split that leaves the
    first stage (the highest rank) one layer, which would hand on its output before the features are added, is
    refused in one line, and no rank started."""
    result = mlxpipe("generate", "--model", str(vision_models["qwen3_vl"]), "--image", str(images[0]),
                     "--prompt", PROMPT, "--hostfile", "hostfiles/local-2.json", "--split", "3,1")
    assert result.returncode != 0
    assert "qwen3_vl: its language model adds the vision tower's deepstack features after layer 0" in result.stderr
    assert "give the last --split entry at least 2 layers" in result.stderr
    assert "starting" not in result.stderr


def test_tensor_parallel_the_sharder_cannot_split_refused_before_launch(vision_models: VisionModels,
                                                                        images: list[Path]) -> None:
    """--tp 2 on Llama 4 (whose experts' router the sharder does not split): one line, and no rank started."""
    result = mlxpipe("generate", "--model", str(vision_models["llama4"]), "--image", str(images[0]),
                     "--prompt", PROMPT, "--hostfile", "hostfiles/local-2.json", "--tp", "2")
    assert result.returncode != 0
    assert "--tp 2: llama4: the tensor-parallel sharder cannot split mlx-vlm's model" in result.stderr
    assert "starting" not in result.stderr


def test_bad_image_file_refused(vision_models: VisionModels, tmp_path: Path) -> None:
    """A file that is no image: one line naming the flag and the file."""
    bad = tmp_path / "notes.png"
    bad.write_text("not a picture")
    result = mlxpipe("generate", "--model", str(vision_models["qwen2_5_vl"]), "--image", str(bad), "--prompt", PROMPT)
    assert result.returncode != 0
    assert f"--image {bad}: the image data is not an image that can be decoded" in result.stderr


@pytest.mark.ranks
def test_chat_keeps_the_image_for_every_turn(vision_models: VisionModels, images: list[Path]) -> None:
    """``chat --image``: the picture belongs to the first message; a second turn reuses the cached prefix."""
    result = subprocess.run(
        [MLXPIPE, "chat", "--model", str(vision_models["qwen2_5_vl"]), "--image", str(images[0]),
         "--max-tokens", "4", "--hostfile", "hostfiles/local-2.json"],
        input="Describe this.\nAnd again?\n\n", capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("tok/s") == 2


# --- serve: OpenAI Chat's image_url parts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_server(vision_models: VisionModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ready_server(["--model", str(vision_models["qwen2_5_vl"]), "--hostfile", "hostfiles/local-2.json"],
                      tmp_path_factory.mktemp("vision-serve-home")) as proc:
        yield proc


def _data_uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _ask(client: OpenAI, *uris: str) -> Any:
    model = client.models.list().data[0].id
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": uri}} for uri in uris]
    content.append({"type": "text", "text": PROMPT})
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True,
    )


@pytest.mark.ranks
def test_serve_openai_image_equals_mlx_vlm(vision_server: ServeProcess, vision_models: VisionModels,
                                           images: list[Path], reference: dict[tuple[str, int], list[int]]) -> None:
    """A data: URI image through the official client: mlx-vlm's greedy tokens, another image other tokens, and the
    same image again (its prefix from the prompt cache, keyed by the image's hash) the same tokens."""
    from mlx_vlm.utils import load_tokenizer

    tokenizer = load_tokenizer(vision_models["qwen2_5_vl"])
    client = OpenAI(base_url=vision_server.url, api_key="none")
    pieces = {}
    for picture in (0, 1, 0):
        reply = _ask(client, _data_uri(images[picture].read_bytes()))
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
        if picture in pieces:
            assert tokens == pieces[picture]
        pieces[picture] = tokens
        assert tokens == [tokenizer.decode([t]) for t in reference["qwen2_5_vl", picture]]
    assert pieces[0] != pieces[1]


@pytest.mark.ranks
def test_serve_bad_images_are_400s_naming_the_part(vision_server: ServeProcess, images: list[Path]) -> None:
    client = OpenAI(base_url=vision_server.url, api_key="none", max_retries=0)
    tiff = io.BytesIO()
    Pil.new("RGB", (8, 8)).save(tiff, format="TIFF")
    good = _data_uri(images[0].read_bytes())
    cases = [
        ((_data_uri(b"hello"),), "messages[0].content[0]", "not an image that can be decoded"),
        ((good, _data_uri(tiff.getvalue(), "tiff")), "messages[0].content[1]", "supported formats"),
        (("data:image/png;base64,@@@",), "messages[0].content[0]", "not valid base64"),
        (("https://example.invalid/a.png",), "messages[0].content[0]", "image URLs are not fetched"),
        ((good,) * 9, "messages[0].content[8]", "at most 8 images"),
    ]
    for uris, param, words in cases:
        with pytest.raises(BadRequestError) as info:
            _ask(client, *uris)
        body = info.value.body
        assert isinstance(body, dict)
        error = body.get("error", body)  # the client hands over the error object, or the whole body
        assert error["param"] == param and words in error["message"], error
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_serve_anthropic_base64_image(vision_server: ServeProcess, vision_models: VisionModels,
                                     images: list[Path]) -> None:
    """Anthropic's base64 image blocks through the official client: the same reply as OpenAI's door gives; a bad
    one is a 400 in Anthropic's shape naming the block."""
    import anthropic

    openai_text = _ask(OpenAI(base_url=vision_server.url, api_key="none"),
                       _data_uri(images[0].read_bytes())).choices[0].message.content
    client = anthropic.Anthropic(base_url=vision_server.base, api_key="none", max_retries=0, timeout=120)

    def ask(data: str) -> Any:
        source = {"type": "base64", "media_type": "image/png", "data": data}
        return client.messages.create(
            model=str(vision_models["qwen2_5_vl"]), max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [{"type": "image", "source": source},  # type: ignore[typeddict-item]
                                                   {"type": "text", "text": PROMPT}]}],
        )

    reply = ask(base64.b64encode(images[0].read_bytes()).decode())
    assert "".join(block.text for block in reply.content if block.type == "text") == openai_text
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(base64.b64encode(b"hello").decode())
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert "'messages[0].content[0].source.data': the image data is not an image" in body["error"]["message"]
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_serve_ollama_images(vision_server: ServeProcess, vision_models: VisionModels, images: list[Path]) -> None:
    """Ollama's ``images`` (base64) through the official client, in /api/chat and /api/generate: the same reply as
    OpenAI's door gives; a bad one is a 400 naming the field."""
    import ollama

    openai_text = _ask(OpenAI(base_url=vision_server.url, api_key="none"),
                       _data_uri(images[0].read_bytes())).choices[0].message.content
    client = ollama.Client(host=vision_server.base)
    model, options = str(vision_models["qwen2_5_vl"]), {"temperature": 0, "num_predict": MAX_TOKENS}
    picture = images[0].read_bytes()
    chat = client.chat(model=model, messages=[{"role": "user", "content": PROMPT, "images": [picture]}],
                       options=options)
    assert chat.message.content == openai_text
    generated = client.generate(model=model, prompt=PROMPT, images=[picture], options=options)
    assert generated.response == openai_text
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=model, messages=[{"role": "user", "content": PROMPT, "images": [b"hello"]}])
    assert info.value.status_code == 400
    assert "'messages[0].images[0]': the image data is not an image" in str(info.value)
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_serve_images_in_flight_together_equal_solo(vision_server: ServeProcess, vision_models: VisionModels,
                                                    images: list[Path],
                                                    reference: dict[tuple[str, int], list[int]]) -> None:
    """Image requests batched together, with a text-only one among them: each gives its solo tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx_vlm.utils import load_tokenizer

    tokenizer = load_tokenizer(vision_models["qwen2_5_vl"])
    client = OpenAI(base_url=vision_server.url, api_key="none")
    text_only = client.chat.completions.create(
        model=str(vision_models["qwen2_5_vl"]), messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS, temperature=0.0,
    ).choices[0].message.content
    uris = [_data_uri(images[picture].read_bytes()) for picture in (1, 0, 1, 0)]
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(_ask, client, uri) for uri in uris]
        alone = pool.submit(lambda: client.chat.completions.create(
            model=str(vision_models["qwen2_5_vl"]), messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS, temperature=0.0,
        )).result()
        replies = [future.result() for future in futures]
    for picture, reply in zip((1, 0, 1, 0), replies, strict=True):
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
        assert tokens == [tokenizer.decode([t]) for t in reference["qwen2_5_vl", picture]]
    assert alone.choices[0].message.content == text_only


@pytest.mark.ranks
def test_serve_responses_input_image(vision_server: ServeProcess, vision_models: VisionModels,
                                     images: list[Path]) -> None:
    """Responses' input_image (a data: URI) through the official client: the same reply as Chat's; a follow-up by
    previous_response_id still sees the picture; a bad one is a 400 naming the part."""
    client = OpenAI(base_url=vision_server.url, api_key="none", max_retries=0)
    model, uri = str(vision_models["qwen2_5_vl"]), _data_uri(images[0].read_bytes())
    chat_text = _ask(client, uri).choices[0].message.content
    content: Any = [{"type": "input_image", "image_url": uri, "detail": "auto"}, {"type": "input_text", "text": PROMPT}]
    first = client.responses.create(model=model, input=[{"role": "user", "content": content}],
                                    max_output_tokens=MAX_TOKENS, temperature=0.0)
    assert first.output_text == chat_text
    follow = client.responses.create(model=model, input="And again?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0.0)
    # Its prompt holds the stored turn, picture included: more tokens than the first, the reply cut at 4.
    assert follow.status == "incomplete" and follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens and follow.usage.output_tokens == 4
    bad: Any = [{"type": "input_image", "image_url": _data_uri(b"hello"), "detail": "auto"}]
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model=model, input=[{"role": "user", "content": bad}], max_output_tokens=4)
    body = info.value.body
    assert isinstance(body, dict)
    error = body.get("error", body)
    assert error["param"] == "input[0].content[0].image_url" and "not an image" in error["message"]
    assert vision_server.health()["restarts"] == 0


# --- serve: images with tools (a coding agent's screenshot and its tools) -----------------------------------------

LOOK = "What is the weather in this picture?"


def _image_turn(uri: str) -> dict[str, Any]:
    return {"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": LOOK}]}


@pytest.mark.ranks
def test_serve_image_with_tools_openai(vision_server: ServeProcess, vision_models: VisionModels,
                                       images: list[Path]) -> None:
    """A picture with tools and a forced call, required and named, through the official client: each reply is one
    parsed call valid against its tool's schema; the follow-up with the call's result beside the picture is a
    normal reply, mlx-vlm's greedy tokens of the same conversation and tools."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import get_chat_template
    from mlx_vlm.utils import prepare_inputs

    client = OpenAI(base_url=vision_server.url, api_key="none", max_retries=0, timeout=300)
    model, uri = str(vision_models["qwen2_5_vl"]), _data_uri(images[0].read_bytes())
    tools: Any = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    calls = {}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = client.chat.completions.create(model=model, messages=[_image_turn(uri)], tools=tools,
                                               tool_choice=choice, parallel_tool_calls=False,  # type: ignore[arg-type]
                                               max_tokens=TOOL_TOKENS, temperature=0.0)
        (call,) = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls[json.dumps(choice)] = reply.choices[0].message
    assert calls['{"type": "function", "function": {"name": "get_time"}}'].tool_calls[0].function.name == "get_time"
    asked = calls['"required"']
    (call,) = asked.tool_calls or []
    history: Any = [_image_turn(uri), asked.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    follow = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=MAX_TOKENS,
                                            temperature=0.0)
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content
    # The prompt is mlx-vlm's of the same conversation (the call's arguments as an object) and tools. (The reply
    # is not mlx-vlm's greedy one: offered tools hold free text to the tool-call grammar, as for a text model.)
    _, processor = load(model)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LOOK}]},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call.id, "type": "function", "function": {
                            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    text = get_chat_template(processor, conversation, True, tools=tools)
    inputs = prepare_inputs(processor, images=[str(images[0])], prompts=text,
                            image_token_index=None)
    assert follow.usage is not None and follow.usage.prompt_tokens == inputs["input_ids"].size
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_serve_image_with_tools_anthropic(vision_server: ServeProcess, vision_models: VisionModels,
                                          images: list[Path]) -> None:
    """Anthropic's base64 picture with a tool forced by name, through the official client: a tool_use block valid
    against the schema; the follow-up with its tool_result (a screenshot in it) beside the picture is a normal reply.
    Without thinking, as Anthropic's own API takes a forced tool: the random model's free reasoning before the call
    can run to max_tokens (the switch reaching the template is the Ollama test's)."""
    import anthropic

    client = anthropic.Anthropic(base_url=vision_server.base, api_key="none", max_retries=0, timeout=300)
    model = str(vision_models["qwen2_5_vl"])
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(images[0].read_bytes()).decode()}
    asked: Any = {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": LOOK}]}
    tools: Any = [{"name": n, "description": f"{n} of a place", "input_schema": s} for n, s in SCHEMAS.items()]
    reply = client.messages.create(model=model, max_tokens=TOOL_TOKENS, messages=[asked], tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMAS["get_weather"])
    # The tool's result holds a picture too (an agent's screenshot): two pictures in the follow-up.
    shot = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(images[1].read_bytes()).decode()}
    result = [{"type": "text", "text": "18 C"}, {"type": "image", "source": shot}]
    history: Any = [asked, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    follow = client.messages.create(model=model, max_tokens=MAX_TOKENS, tools=tools, messages=history,
                                    extra_body={"temperature": 0})
    assert follow.stop_reason in ("end_turn", "max_tokens")

    def prompt(usage: Any) -> int:  # Anthropic counts what the prompt cache gave apart
        return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))

    assert prompt(follow.usage) > prompt(reply.usage) + len(LOOK)  # the call and its result beside the picture
    assert "".join(block.text for block in follow.content if block.type == "text")
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_serve_image_with_tools_responses_and_ollama(vision_server: ServeProcess, vision_models: VisionModels,
                                                     images: list[Path]) -> None:
    """Responses: a picture with a strict tool, required: a function_call valid against the schema, and its output
    after the stored response (the picture with it) gets a reply. Ollama (no tool_choice): a picture with tools and
    ``think``: its prompt is mlx-vlm's of the same message, tools and thinking switch."""
    import ollama
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import get_chat_template
    from mlx_vlm.utils import prepare_inputs

    client = OpenAI(base_url=vision_server.url, api_key="none", max_retries=0, timeout=300)
    model, uri = str(vision_models["qwen2_5_vl"]), _data_uri(images[0].read_bytes())
    tools: Any = [{"type": "function", "name": n, "parameters": s, "strict": True} for n, s in SCHEMAS.items()]
    content: Any = [{"type": "input_image", "image_url": uri, "detail": "auto"}, {"type": "input_text", "text": LOOK}]
    first = client.responses.create(model=model, input=[{"role": "user", "content": content}], tools=tools,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=TOOL_TOKENS, temperature=0.0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    after = client.responses.create(model=model, previous_response_id=first.id, tools=tools, temperature=0.0,
                                    max_output_tokens=MAX_TOKENS,
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert after.status in ("completed", "incomplete") and after.output_text
    assert after.usage is not None and first.usage is not None
    assert after.usage.input_tokens > first.usage.input_tokens  # the stored turn: picture, call and result

    # Ollama's client keeps only the schema keys its Tool type has (type, properties, required, description...).
    city = {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}}, "required": ["city"]}
    functions: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    chat = ollama.Client(host=vision_server.base).chat(
        model=model, messages=[{"role": "user", "content": LOOK, "images": [images[0].read_bytes()]}],
        tools=functions, think=True, options={"temperature": 0, "num_predict": MAX_TOKENS})
    _, processor = load(model)
    asked = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LOOK}]}]
    text = get_chat_template(processor, asked, True, tools=functions, enable_thinking=True)
    assert text.endswith("<think>\n")  # the switch reached the template
    assert chat.prompt_eval_count == prepare_inputs(processor, images=[str(images[0])], prompts=text)["input_ids"].size
    assert chat.message.content  # a reply: tools with a picture are no longer refused
    assert vision_server.health()["restarts"] == 0


@pytest.mark.ranks
def test_the_page_attaches_an_image(vision_server: ServeProcess, images: list[Path], browser: Any) -> None:
    """The page's chat on a vision-language model: an attached file goes as a data: URI image_url part, and the
    streamed reply is the API's greedy reply to the same picture and question."""
    from selenium.webdriver.common.by import By

    data = httpx.get(f"{vision_server.url}/cluster", timeout=30).json()  # the page's data: the limits
    assert data["images"] == {"max_bytes": 20 * 1024 * 1024, "max_images": 8}
    _open(browser, vision_server.base, key=None)
    _until(browser, lambda d: d.find_element(By.ID, "attach").is_displayed(), "the attach control")
    browser.find_element(By.ID, "chat-image").send_keys(str(images[0]))
    _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#attached img.thumb"), "the attached picture")
    browser.find_element(By.TAG_NAME, "summary").click()  # the options
    for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "chat-input").send_keys(PROMPT)
    browser.find_element(By.ID, "send").click()
    reply = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'), "a reply")
    assert not reply.find_elements(By.CLASS_NAME, "error"), reply.text
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img.thumb")  # the turn shows its picture
    assert not browser.find_elements(By.CSS_SELECTOR, "#attached img")  # sent: the next message starts bare
    streamed = browser.execute_script("return arguments[0].textContent", reply.find_element(By.CLASS_NAME, "text"))
    client = OpenAI(base_url=vision_server.url, api_key="none")
    assert streamed == _ask(client, _data_uri(images[0].read_bytes())).choices[0].message.content and streamed
    assert vision_server.health()["restarts"] == 0


# A reply long enough that the kill, sent as its first token arrives, always finds it running (~150 tok/s on 2 ranks
# here; the client can lag seconds behind the ranks on a loaded machine).
RESUMED_TOKENS = 800


@pytest.mark.ranks
def test_serve_a_killed_rank_resumes_an_image_request_as_mlx_vlms_reply(vision_server: ServeProcess,
                                                                         vision_models: VisionModels,
                                                                         images: list[Path]) -> None:
    """Last on ``vision_server``: ``kill -9`` of rank 1 as a reply about a picture starts. The request goes on
    after the relaunch, the picture's features made again for its prompt and the reply so far embedded as text, and
    the client's tokens are mlx-vlm's greedy reply, whole."""
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_tokenizer

    model, processor = load(str(vision_models["qwen2_5_vl"]))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    expected = [r.token for r in stream_generate(model, processor, prompt, image=[str(images[0])],
                                                 max_tokens=RESUMED_TOKENS, temperature=0.0)][:RESUMED_TOKENS]
    tokenizer = load_tokenizer(vision_models["qwen2_5_vl"])
    client = OpenAI(base_url=vision_server.url, api_key="none", max_retries=0, timeout=300)
    content = [{"type": "image_url", "image_url": {"url": _data_uri(images[0].read_bytes())}},
               {"type": "text", "text": PROMPT}]
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        max_tokens=RESUMED_TOKENS, temperature=0.0, logprobs=True, stream=True)
    tokens: list[str] = []
    chunks = iter(stream)
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            tokens += [entry.token for entry in chunk.choices[0].logprobs.content]
        if tokens:
            break
    worker = next(pid for pid, (rank, cmd) in local_rank_processes(vision_server.proc.pid).items()
                  if rank == 1 and "mlxpipe.launch.supervisor" not in cmd)
    os.kill(worker, signal.SIGKILL)
    for chunk in chunks:  # an error would raise here
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            tokens += [entry.token for entry in chunk.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([t]) for t in expected]
    assert vision_server.health()["restarts"] == 1  # it was resumed, not finished before the kill
    assert vision_server.said("tokens replayed")
