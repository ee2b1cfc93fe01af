"""The decode cost of enforced tool calls (issue 32): free decoding against the grammar engine, on 2 ranks.

    python bench/bench_tools.py            # what `make bench` runs (~9 minutes on a loaded 2-core CPU)
    python bench/bench_tools.py --quick    # smoke run: one short generation per mode
    python bench/bench_tools.py --runs 9 --max-tokens 160

One checkpoint: the demo model (SmolLM2-135M-Instruct, 30 layers, 4-bit; a 49,152-token vocabulary, so each mask
is a real vocabulary's) with a chat template that takes tools in Qwen2.5's hermes format, so mlx-lm reads its calls
with the ``json_tools`` parser (``tests/fixtures/tool_model.py``'s template). One prompt (the tools listed, a
request to save a poem), greedy, through ``mlxpipe.launch.pipeline.Pipeline`` on 2 local ranks, each worker pinned
to a core of its own: rank 0's engine samples every token, the grammar's mask applied when a request has one. Three
modes of the same request:

* ``free``: no grammar (the model's own decoding);
* ``auto``: the tools offered under ``tool_choice`` auto: the lazy grammar, awake only once a call opens, as every
  request with tools runs (the greedy demo model may or may not open one);
* ``forced``: ``tool_choice`` required: the call's grammar from the first token, a JSON string argument long
  enough for the model to write in.

The figure is rank 0's generation tok/s (tokens after the first over the time after the first), the median of
--runs generations per mode after one warm-up each, the modes interleaved run by run so that load on the machine
falls on all three alike; the time to the first token is shown too (a grammar's compile falls there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import cpu_name, pinned_pipeline, placement

RANKS = 2
POEM = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "text": {"type": "string", "maxLength": 1200}},
        "required": ["title", "text"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = {"save_poem": POEM, "get_weather": WEATHER}
ASK = "Write a long poem about the sea, with a title, and save it with the save_poem tool."
MODES = ("free", "auto", "forced")


@dataclass
class Figures:
    tps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)


def tool_demo_model(dest: Path) -> Path:
    """The demo model with a chat template that takes tools (its shards linked, not copied)."""
    from fixtures.tool_model import TOOL_TEMPLATE
    from mlxpipe.model.demo import ensure_demo_model

    demo = ensure_demo_model()
    dest.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":
            os.symlink(f, dest / f.name)
    config = json.loads((demo / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return dest


def requests(model: Path, max_tokens: int) -> dict[str, Any]:
    """The same prompt in each mode, as the ranks run it (token ids; the grammar's spec for auto and forced)."""
    from mlx_lm.tokenizer_utils import load

    from mlxpipe.launch.pipeline import Request
    from mlxpipe.protocol.tools import Tool, ToolCalls
    from mlxpipe.worker.generation.tool_formats import format_of

    tokenizer = load(model)
    template_tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()]
    text = tokenizer.apply_chat_template([{"role": "user", "content": ASK}], tools=template_tools, tokenize=False,
                                         add_generation_prompt=True)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    fmt = format_of(tokenizer)
    assert fmt == "json_tools", fmt
    tools = tuple(Tool(n, s) for n, s in TOOLS.items())
    base = Request(tokens=tokens, max_tokens=max_tokens)
    return {"free": base, "auto": Request(tokens=tokens, max_tokens=max_tokens, tool_calls=ToolCalls(fmt, tools)),
            "forced": Request(tokens=tokens, max_tokens=max_tokens,
                              tool_calls=ToolCalls(fmt, tools, required=True, parallel=False))}


def measure(model: Path, runs: int, max_tokens: int) -> dict[str, Figures]:
    """Each mode's figures, the modes interleaved run by run."""
    from dataclasses import replace

    asks = requests(model, max_tokens)
    figures = {mode: Figures() for mode in MODES}
    with pinned_pipeline(model, RANKS) as pipe:
        for mode in MODES:  # warm-up: the first request of each kind (and llguidance's tokenizer) off the clock
            pipe.generate(replace(asks[mode], max_tokens=8))
        for _ in range(runs):
            for mode in MODES:
                answer = pipe.generate(asks[mode])
                f = figures[mode]
                f.tps.append(answer.generation_tps)
                f.ttft.append(answer.ttft or 0.0)
                f.tokens.append(answer.generation_tokens)
                f.finish.append(str(answer.finish_reason))
    return figures


def table(figures: dict[str, Figures]) -> str:
    free = statistics.median(figures["free"].tps)
    lines = ["| mode | generation tok/s (median) | vs free | tokens per run | time to first token (median) |",
             "|---|---:|---:|---:|---:|"]
    for mode in MODES:
        f = figures[mode]
        tps = statistics.median(f.tps)
        tokens = sorted(set(f.tokens))
        lines.append(f"| {mode} | {tps:.2f} | {tps / free:.2f}x | {', '.join(map(str, tokens))} "
                     f"| {statistics.median(f.ttft):.2f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="one short generation per mode")
    args = parser.parse_args()
    runs, max_tokens = (1, 16) if args.quick else (args.runs, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="mlxpipe-bench-") as tmp:
        os.environ.setdefault("MLXPIPE_HOME", str(Path(tmp) / "home"))
        model = tool_demo_model(Path(tmp) / "demo-tools")
        figures = measure(model, runs, max_tokens)
        shutil.rmtree(model, ignore_errors=True)
    print("## Enforced tool calls: decode tok/s against free decoding\n")
    print(table(figures))
    print(f"\nThe demo model with a hermes tool template, {RANKS} local ranks ({placement(RANKS)}), greedy, "
          f"max_tokens {max_tokens}, median of {runs} runs per mode (interleaved), after one warm-up; "
          f"{cpu_name()}, {os.cpu_count()} cores. Finish reasons: "
          + "; ".join(f"{m}: {', '.join(sorted(set(figures[m].finish)))}" for m in MODES) + ".")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
