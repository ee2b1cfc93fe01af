"""``mlxpipe generate`` (one prompt, or many with ``--prompts-file``) and ``mlxpipe chat``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxpipe import console
from mlxpipe.cli._generation import check_draft_flags, settle_config
from mlxpipe.cli._groups import LaunchFlags, RequestFlags, Take, TargetFlags, option_groups
from mlxpipe.cli._options import DecodeBatch, Json
from mlxpipe.defaults import DEFAULT_DECODE_BATCH
from mlxpipe.errors import MlxpipeError, RequestFailed, UsageError
from mlxpipe.protocol.request import Image, Request

if TYPE_CHECKING:
    from mlxpipe.launch.batch import RequestResult
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.pipeline import Pipeline

Images = Annotated[list[Path] | None, typer.Option(
    "--image", help="An image for a vision-language model (PNG, JPEG, WebP, GIF, BMP); repeat it for several. "
    "Needs mlx-vlm: pip install 'mlxpipe\\[vision]'.", show_default="none: text only",
)]
Prompt = Annotated[str | None, typer.Option(
    "--prompt", "-p", help="The prompt; '-' reads it from standard input.",
    show_default="none: required without --prompts-file",
)]
PromptsFile = Annotated[Path | None, typer.Option(
    "--prompts-file",
    help="Many prompts: one per line, or JSON Lines with per-prompt options (prompt or messages, max_tokens, "
    "temp, top_p, min_p, seed, id). Overlapped across the ranks so every stage is busy.",
    show_default="none: one --prompt",
)]
Concurrency = Annotated[int | None, typer.Option(
    "--concurrency", help="With --prompts-file: requests in flight at once.",
    show_default="pipeline stages x --decode-batch",
)]
Output = Annotated[Path | None, typer.Option(
    "--output", "-o",
    help="With --prompts-file: write one JSON object per request here, in input order, instead of printing the "
    "texts. Until the batch is done, finished results are kept in FILE.partial as they come.",
    show_default="none: texts printed",
)]


@option_groups
def generate(
    *,
    prompt: Prompt = None,
    image: Images = None,
    target: TargetFlags,
    request: RequestFlags,
    launch: LaunchFlags,
    prompts_file: PromptsFile = None,
    concurrency: Concurrency = None,
    output: Output = None,
    decode_batch: DecodeBatch = DEFAULT_DECODE_BATCH,
    json_out: Json = False,
) -> None:
    """Run the model across the hosts (a pipeline, --tp groups, or both) and stream the answer.

    With no --model and no --hostfile: the demo model on two local ranks (hostfiles/local-2.json).
    With --prompts-file: many requests, overlapped so that every rank computes at once.

    Example: mlxpipe generate --prompt "What is the capital of France?"

    Example: mlxpipe generate --prompts-file prompts.txt --concurrency 2 --output results.jsonl
    """
    import sys

    from mlxpipe.cli.render import answer_table
    from mlxpipe.launch.pipeline import request_for
    from mlxpipe.launch.run import running_pipeline

    _check_generate_flags(prompt, prompts_file, concurrency, output, launch.draft_model)
    check_draft_flags(launch.draft_model, request.max_kv_size)
    if prompt == "-":
        prompt = sys.stdin.read()
    if target.workload is None and prompts_file is not None:
        target = replace(target, workload="batch")  # many prompts at once: judged by aggregate throughput
    if image and prompts_file is not None:
        raise UsageError("--image goes with --prompt, not --prompts-file")
    images = read_images(image)
    the_target = target.target()
    options = request.request(the_target.preset)
    config = settle_config(launch.config(the_target, quiet=json_out, images=bool(images)), quiet=json_out)
    if prompts_file is not None:
        _generate_batch(config, options, prompts_file, concurrency, output, json_out, decode_batch)
        return
    with running_pipeline(config) as pipe:
        answer = pipe.generate(replace(request_for(prompt, None, options), images=images),
                               None if json_out else _stream_text)
    if json_out:
        console.print_json({**answer.to_json(), "run_dir": str(pipe.run_dir)})
    else:
        console.out.print()
        console.err.print(answer_table(answer))


def _check_generate_flags(prompt: str | None, prompts_file: Path | None, concurrency: int | None,
                          output: Path | None, draft_model: str | None) -> None:
    """One prompt or a file of them, and the flags that go with each, refused before anything starts."""
    if prompts_file is not None and prompt is not None:
        raise UsageError("give --prompt or --prompts-file, not both")
    if prompts_file is None and (concurrency is not None or output is not None):
        raise UsageError("--concurrency and --output go with --prompts-file")
    if prompts_file is None and prompt is None:
        raise UsageError("--prompt is required ('-' reads standard input)", 'mlxpipe generate --prompt "Hello"')
    if prompts_file is not None and draft_model is not None and concurrency not in (None, 1):
        raise UsageError("--concurrency: with --draft-model the prompts run one at a time (speculative decoding "
                         "is not batched, as in mlx-lm)", "drop --concurrency")


def _generate_batch(config: PipelineConfig, defaults: Request, prompts_file: Path,
                    concurrency: int | None, output: Path | None, json_out: bool, decode_batch: int) -> None:
    """``generate --prompts-file``: every request overlapped; texts in input order, then the summary."""
    from mlxpipe.cli.render import batch_table
    from mlxpipe.launch.batch import ResultsFile, check_decode_batch, read_prompts
    from mlxpipe.launch.run import running_pipeline

    if config.mode != "generic":
        raise UsageError("--prompts-file overlaps requests with the generic pipeline", "drop --pipeline native")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {concurrency}")
    check_decode_batch(decode_batch)
    if config.draft_model is not None:
        concurrency, decode_batch = 1, 1  # one prompt after another (checked above)
    if output is not None and not output.parent.is_dir():
        raise UsageError(f"--output {output}: no directory {output.parent}")
    requests = read_prompts(prompts_file, defaults)
    saved = ResultsFile(output) if output is not None else None
    try:
        with running_pipeline(config) as pipe:
            on_result = None if json_out or output else _print_result
            result = pipe.generate_batch(requests, concurrency, on_result, saved.add if saved else None,
                                         decode_batch=decode_batch)
    except BaseException as e:
        kept = saved.abandon() if saved else None
        if kept and isinstance(e, MlxpipeError):
            e.hint = f"{e.hint}; {kept}" if e.hint else kept
        elif kept:
            console.warn(kept)
        raise
    if saved is not None:
        saved.finish(result.results)
    if json_out:
        results = {} if output else {"results": [r.to_json() for r in result.results]}
        console.print_json({**results, "summary": result.summary(), "run_dir": str(pipe.run_dir)})
    else:
        console.err.print(batch_table(result))
    if result.failed:
        names = ", ".join(str(r.id) for r in result.failed[:5]) + (" ..." if len(result.failed) > 5 else "")
        raise RequestFailed(f"{len(result.failed)} of {len(result.results)} requests failed ({names}): "
                            f"{result.failed[0].error}", "the others ran to their end; their results are kept")


def _print_result(result: RequestResult) -> None:
    console.out.rule(f"{result.id}", align="left")
    if result.error is not None:
        console.error(f"request {result.id} failed: {result.error}")
        return
    console.out.print(result.text, markup=False, highlight=False, soft_wrap=True)


def _stream_text(text: str) -> None:
    import sys

    sys.stdout.write(text)
    sys.stdout.flush()


@option_groups
def chat(
    *,
    image: Images = None,
    target: TargetFlags,
    request: Annotated[RequestFlags, Take(drop=("ignore_chat_template", "prefill_response"))],
    launch: LaunchFlags,
) -> None:
    """Multi-turn chat with the model across the hosts; each turn reuses the prompt cache.

    Type a message and press Enter; an empty line or Ctrl-D ends the chat.
    """
    from mlxpipe.launch.run import running_pipeline

    check_draft_flags(launch.draft_model, request.max_kv_size)
    images = read_images(image)
    the_target = target.target()
    options = request.request(the_target.preset)
    config = settle_config(launch.config(the_target, quiet=False, images=bool(images)), quiet=False)
    with running_pipeline(config) as pipe:
        _chat_turns(pipe, replace(options, images=images))


def read_images(paths: list[Path] | None) -> tuple[Image, ...]:
    """The --image files, checked (and mlx-vlm asked for) before anything starts."""
    if not paths:
        return ()
    from mlxpipe.vision.images import read_image_file
    from mlxpipe.vision.prompt import require_vision

    require_vision()
    return tuple(read_image_file(str(path)) for path in paths)


def _with_images(text: str, count: int) -> list[dict[str, str]]:
    """A chat message's content with ``count`` images first, then its text."""
    return [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]


def _chat_turns(pipe: Pipeline, options: Request) -> None:
    """Read a message, stream the reply, until an empty line or the end of the input."""
    import sys

    from mlxpipe.launch.pipeline import request_for

    messages: list[dict[str, Any]] = []
    while True:
        console.err.print("[bold]>[/] ", end="")
        line = sys.stdin.readline()
        if not line.strip():
            break
        # The chat's images (--image) belong to its first message, where they stay for every later turn.
        text = line.rstrip("\n")
        first = options.images and not messages
        messages.append({"role": "user", "content": _with_images(text, len(options.images)) if first else text})
        try:
            answer = pipe.generate(request_for(None, messages, options, keep_cache=True), _stream_text)
        except RequestFailed as e:  # this turn failed, the pipeline did not: the chat goes on
            messages.pop()
            console.error(e.message, e.hint)
            continue
        console.out.print()
        messages.append({"role": "assistant", "content": answer.text})
        console.err.print(f"[dim]{answer.generation_tokens} tokens, {answer.generation_tps:.1f} tok/s[/]")
