"""Images in (issue 33): time to first token for one image and a short question, single-process mlx-vlm against
2 ranks, and where the vision tower's time goes.

    python bench/bench_vision.py            # what `make bench` runs (a few minutes here)
    python bench/bench_vision.py --quick    # the tests' tiny Qwen2.5-VL, two repeats

The model is a random float32 Qwen2.5-VL (``fixtures/vision_models.py``, made larger: 8 language layers of hidden
512, a vision tower of 8 blocks of hidden 256) and the picture a random 448x448 PNG, which its processor turns into
1024 patches, 256 image tokens after the merge. Each repeat is one request, greedy, ``max_tokens`` 1, after a
warm-up:

1. single-process mlx-vlm, pinned to one core: ``mlx_vlm.stream_generate`` from the call to its first token (the
   picture read, processed, through the vision tower, the prompt prefilled). Then, apart, the image processor
   (``prepare_inputs``) and the vision tower and projector (``get_input_embeddings``, evaluated) alone;
2. mlxpipe on 2 local ranks, each pinned to a core of its own (``common.pinned_pipeline``): from the request made
   on the controller (the processor tokenizes it there) to its one token back (``generate_batch``). The vision
   tower runs on the first stage (rank 1, which processes the pixels again); each rank's time report
   (``TimeSpent``, read by ``where_time_goes``) says how busy it was and how much of its computing the vision
   tower took.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, cores, cpu_name, placement, run_pinned

sys.path.insert(0, str(REPO))  # the fixtures import tests.fixtures.tiny_models

RANKS = 2
REPEATS = 3
QUESTION = "What is in this picture?"
PICTURE = (448, 448)
QUICK_PICTURE = (64, 48)
TEXT = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}
VISION = {"depth": 8, "hidden_size": 256, "intermediate_size": 512, "out_hidden_size": 512, "num_heads": 4,
          "window_size": 112, "fullatt_block_indexes": [3, 7]}
LAYERS = 8
PROCESSOR = {"max_pixels": PICTURE[0] * PICTURE[1]}


def build(root: Path, quick: bool) -> tuple[Path, Path]:
    """The checkpoint and the picture."""
    from fixtures.vision_models import make_vision_checkpoint, test_image

    if quick:
        model = make_vision_checkpoint("qwen2_5_vl", root / "model")
    else:
        model = make_vision_checkpoint("qwen2_5_vl", root / "model", num_layers=LAYERS,
                                       config_overrides={**TEXT, "vision_config": VISION},
                                       processor_overrides=PROCESSOR)
    picture = root / "picture.png"
    picture.write_bytes(test_image(0, QUICK_PICTURE if quick else PICTURE))
    return model, picture


# --- single-process mlx-vlm (a pinned child) -------------------------------------------------


def single(model_dir: str, picture: str, repeats: int) -> dict[str, Any]:
    """mlx-vlm's time to first token, then its image processor's and vision tower's times alone."""
    import mlx.core as mx
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    from mlxpipe.vision.images import read_image_file
    from mlxpipe.vision.prompt import process

    model, processor = load(model_dir)
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    image = read_image_file(picture)
    ttft, processing, tower, tokens = [], [], [], 0
    for i in range(repeats + 1):  # the first: a warm-up
        tic = time.perf_counter()
        for _ in stream_generate(model, processor, prompt, image=[picture], max_tokens=1, temperature=0.0):
            break
        first = time.perf_counter() - tic
        tic = time.perf_counter()
        inputs = process(processor, config, prompt, (image,))
        ids, pixels = inputs.pop("input_ids"), inputs.pop("pixel_values")
        mx.eval(ids, pixels)
        processed = time.perf_counter() - tic
        kwargs = {k: v for k, v in inputs.items() if v is not None and k != "attention_mask"}
        tic = time.perf_counter()
        mx.eval(model.get_input_embeddings(ids, pixels, mask=inputs.get("attention_mask"), **kwargs).inputs_embeds)
        embedded = time.perf_counter() - tic
        if i:
            ttft.append(first)
            processing.append(processed)
            tower.append(embedded)
        tokens = int(ids.size)
    return {"ttft": ttft, "processor": processing, "tower": tower, "prompt_tokens": tokens}


# --- mlxpipe on 2 ranks ----------------------------------------------------------------------


def ranks(model: Path, picture: Path, repeats: int) -> dict[str, Any]:
    """mlxpipe's time to first token on 2 pinned ranks, and each rank's time report per request."""
    from common import pinned_pipeline

    from mlxpipe.protocol.request import Request
    from mlxpipe.vision.images import read_image_file

    image = read_image_file(str(picture))
    ttft, rank0, controller, times = [], [], [], []
    with pinned_pipeline(model, RANKS, images=True) as pipe:
        for i in range(repeats + 1):  # the first: a warm-up
            tic = time.perf_counter()
            request = pipe.with_images(Request(prompt=QUESTION, images=(image,), max_tokens=1, temp=0.0))
            tokenized = time.perf_counter() - tic
            result = pipe.generate_batch([request], concurrency=1)
            first = time.perf_counter() - tic
            if result.results[0].error:
                raise RuntimeError(result.results[0].error)
            if i:
                ttft.append(first)
                controller.append(tokenized)
                rank0.append(result.results[0].ttft)
                times.append(result.time)
    return {"ttft": ttft, "controller": controller, "rank0_ttft": rank0, "times": times,
            "prompt_tokens": len(request.tokens or ())}


def summed(times: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Each rank's reports over the repeats, added up (busy: the computing share of their working time)."""
    total: dict[int, dict[str, float]] = {}
    for report in times:
        for rank, spent in report.items():
            into = total.setdefault(rank, {})
            for key, value in spent.items():
                into[key] = into.get(key, 0.0) + value
    for spent in total.values():
        working = spent["wall"] - spent["idle"]
        spent["busy"] = spent["compute"] / working if working > 0 else 0.0
    return total


# --- the report --------------------------------------------------------------------------------


def report(one: dict[str, Any], two: dict[str, Any], quick: bool) -> None:
    from mlxpipe.launch.timing import where_time_goes

    med = statistics.median
    n = len(one["ttft"])
    size = QUICK_PICTURE if quick else PICTURE
    print(f"| one {size[0]}x{size[1]} picture + a short question ({one['prompt_tokens']} prompt tokens) "
          "| TTFT (median) | vs mlx-vlm |")
    print("|---|---:|---:|")
    print(f"| single-process mlx-vlm, 1 core | {med(one['ttft']):.3f} s | 1.00x |")
    print(f"| mlxpipe, 2 ranks (1 core each) | {med(two['ttft']):.3f} s | {med(one['ttft']) / med(two['ttft']):.2f}x |")
    where = where_time_goes(summed(two["times"]))
    per = len(two["times"])
    print("\n| rank | stage | busy | computing | of it, the vision tower | waiting for input | sending | "
          "waiting for tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in where["ranks"]:
        stage = "first (vision tower, first layers)" if r["rank"] == RANKS - 1 else "last (last layers, sampling)"
        print(f"| {r['rank']} | {stage} | {r['busy']:.0%} | {r['compute_s'] / per:.3f} s | {r['vision_s'] / per:.3f} s "
              f"| {r['recv_s'] / per:.3f} s | {r['send_s'] / per:.3f} s | {r['sync_s'] / per:.3f} s |")
    print(f"\n- mlx-vlm alone: its image processor {med(one['processor']):.3f} s, the vision tower and projector "
          f"{med(one['tower']):.3f} s of its {med(one['ttft']):.3f} s (medians)")
    print(f"- mlxpipe: the controller's processor tokenizing the request {med(two['controller']):.3f} s; rank 0's "
          f"own time to first token {med(two['rank0_ttft']):.3f} s; per-rank figures are means per request over "
          f"{per} requests")
    model = "the tests' tiny Qwen2.5-VL" if quick else (
        f"random float32 Qwen2.5-VL, {LAYERS} language layers of hidden {TEXT['hidden_size']}, a vision tower of "
        f"{VISION['depth']} blocks of hidden {VISION['hidden_size']}")
    print(f"- {cpu_name()}, {len(cores())} usable cores, {platform.system()} {platform.machine()}; mlx-vlm pinned to "
          f"{placement(0)}, ranks pinned {placement(RANKS)}; {model}; greedy, max_tokens 1, {n} repeats after a "
          "warm-up; TTFT is the caller's wall time from the request to its token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tests' tiny model, two repeats")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="measured requests per side")
    parser.add_argument("--single", nargs=3, metavar=("MODEL", "PICTURE", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:  # the pinned child
        sys.path.insert(0, str(REPO))
        print(json.dumps(single(args.single[0], args.single[1], int(args.single[2]))))
        return
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-vision-") as tmp:
        model, picture = build(Path(tmp), args.quick)
        child = run_pinned(__file__, ["--single", str(model), str(picture), str(repeats)])
        one = json.loads(child.stdout.strip().splitlines()[-1])
        two = ranks(model, picture, repeats)
    report(one, two, args.quick)


if __name__ == "__main__":
    main()
