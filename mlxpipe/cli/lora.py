"""``mlxpipe lora``: LoRA fine-tuning with the model pipelined across the hosts."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from mlxpipe.cli._groups import LaunchFlags, Take, TargetFlags, option_groups
from mlxpipe.errors import UsageError

if TYPE_CHECKING:
    from mlxpipe.lora.options import TrainOptions


@dataclass(frozen=True)
class TrainFlags:
    """mlx_lm.lora's flags, as given (None, False: not given, so the ``-c`` file may set them)."""

    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Hub repo id or local directory.", show_default="the -c file's, else the demo model"
    )] = None
    train: Annotated[bool, typer.Option(
        "--train", help="Train (mlx_lm.lora's flag; the -c file may set it instead)."
    )] = False
    data: Annotated[str | None, typer.Option(
        "--data", help="Directory with train.jsonl, valid.jsonl (and test.jsonl): mlx_lm.lora's text, "
        "completions or chat formats.", show_default="data, or the -c file's",
    )] = None
    fine_tune_type: Annotated[str | None, typer.Option(
        "--fine-tune-type", help="lora or dora.", show_default="lora"
    )] = None
    optimizer: Annotated[str | None, typer.Option(
        "--optimizer", help="adam, adamw, muon, sgd or adafactor.", show_default="adam"
    )] = None
    mask_prompt: Annotated[bool, typer.Option("--mask-prompt", help="Leave the prompt out of the loss.")] = False
    num_layers: Annotated[int | None, typer.Option(
        "--num-layers", help="Layers to fine-tune, from the last; -1 for all.", show_default="16"
    )] = None
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", help="Sequences per step.", show_default="4"
    )] = None
    iters: Annotated[int | None, typer.Option("--iters", help="Training steps.", show_default="1000")] = None
    val_batches: Annotated[int | None, typer.Option(
        "--val-batches", help="Validation batches; -1 for the whole validation set.", show_default="25"
    )] = None
    learning_rate: Annotated[float | None, typer.Option(
        "--learning-rate", help="Learning rate.", show_default="1e-5"
    )] = None
    steps_per_report: Annotated[int | None, typer.Option(
        "--steps-per-report", help="Steps between loss reports.", show_default="10"
    )] = None
    steps_per_eval: Annotated[int | None, typer.Option(
        "--steps-per-eval", help="Steps between validations.", show_default="200"
    )] = None
    resume_adapter_file: Annotated[str | None, typer.Option(
        "--resume-adapter-file", help="Start from these adapter weights.", show_default="none"
    )] = None
    adapter_path: Annotated[str | None, typer.Option(
        "--adapter-path", help="Where adapters.safetensors, adapter_config.json and checkpoints go (this machine).",
        show_default="adapters",
    )] = None
    save_every: Annotated[int | None, typer.Option(
        "--save-every", help="Steps between checkpoints.", show_default="100"
    )] = None
    test: Annotated[bool, typer.Option("--test", help="Evaluate on test.jsonl after training.")] = False
    test_batches: Annotated[int | None, typer.Option(
        "--test-batches", help="Test batches; -1 for all.", show_default="500"
    )] = None
    max_seq_length: Annotated[int | None, typer.Option(
        "--max-seq-length", help="Longest sequence; longer ones are cut.", show_default="2048"
    )] = None
    train_config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="mlx_lm.lora YAML file (lora_parameters, lr_schedule, ...); flags win over it.",
        show_default="none",
    )] = None
    grad_checkpoint: Annotated[bool, typer.Option(
        "--grad-checkpoint", help="Recompute activations in the backward to save memory."
    )] = False
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed of the LoRA initialisation and the batch order.", show_default="0"
    )] = None
    micro_batches: Annotated[int | None, typer.Option(
        "--micro-batches", help="Micro-batches per step, flowing through the stages one behind the other; "
        "gradients are accumulated, so the result equals one batch's.", show_default="1",
    )] = None
    schedule: Annotated[str | None, typer.Option(
        "--schedule", help="1f1b (each stage alternates forwards and backwards, holding at most as many "
        "micro-batches as stages after it) or gpipe (all forwards, then all backwards).", show_default="1f1b",
    )] = None

    def options(self, trust_remote_code: bool) -> TrainOptions:
        """The run's options: these flags over the ``-c`` file over mlx_lm.lora's defaults, checked as they are
        born (naming their flags)."""
        from mlxpipe.lora.options import TrainOptions

        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train_config"}
        given["trust_remote_code"] = trust_remote_code
        return TrainOptions.build({k: v or None if isinstance(v, bool) else v for k, v in given.items()},
                                  self.train_config)


@option_groups
def lora(
    *,
    run: TrainFlags,
    cluster: Annotated[TargetFlags, Take(only=("hostfile", "revision", "strategy", "split", "tp"))],
    launch: Annotated[LaunchFlags, Take(only=("backend", "ring_port", "timeout", "trust_remote_code",
                                               "from_controller"))],
    json_out: Annotated[bool, typer.Option(
        "--json", help="One JSON object per line: every step, validation, checkpoint, then a summary."
    )] = False,
) -> None:
    """Fine-tune LoRA adapters with the model pipelined across the hosts (mlx_lm.lora's flags and data).

    Each rank holds its own layers (frozen; quantized bases work) and their adapters; rank 0 runs the
    last layers and the loss. Losses and adapters equal single-process mlx_lm.lora's with the same flags.
    The adapters are written here, in mlx-lm's format: mlx_lm.generate --adapter-path loads them.

    Example: mlxpipe lora --model mlx-community/Llama-3.2-1B-Instruct-4bit --train --data data --iters 100
    """
    from mlxpipe.lora.report import LoraReporter
    from mlxpipe.lora.training import train

    if cluster.tp not in (None, 1):
        raise UsageError(f"--tp {cluster.tp}: LoRA training does not run on tensor-parallel groups yet",
                         "drop --tp: each rank trains its own layers of the pipeline")
    options = run.options(launch.trust_remote_code)
    # The model may be the -c file's, and --config is that file, not a preset.
    target = replace(cluster, model=options.model, tp=None, layout="pipeline").target()
    config = replace(launch, trust_remote_code=options.trust_remote_code).config(target, quiet=json_out)
    reporter = LoraReporter(json_out)
    reporter.summary(train(config, options, reporter))
