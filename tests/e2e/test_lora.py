"""``mlxpipe lora`` end to end on ranks of this machine, against single-process mlx_lm.lora.

With the same model, data, seed and flags (float32), the loss of every step,
the validation losses and the adapter weights must equal mlx_lm.lora's own
(``train_model``, run in this process), whatever the number of ranks, the
micro-batches and the schedule. Each launch checks several things at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from fixtures.cli import MLXPIPE, REPO

pytestmark = pytest.mark.ranks

TIMEOUT = 240
# Adam turns float noise in near-zero gradients into steps of up to the learning rate, so a
# modest one keeps the comparison about the pipeline, not about rounding (mlx_lm's default is 1e-5).
FLAGS = {"batch_size": 4, "iters": 4, "num_layers": 3, "learning_rate": 1e-4, "steps_per_eval": 2,
         "val_batches": 2, "save_every": 2, "steps_per_report": 1}


def reference(out: Path, **flags: Any) -> dict[str, Any]:
    """Single-process mlx_lm.lora (its own ``train_model``) with ``flags``; per-step losses and weights."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import lora as mlx_lora
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import load

    args = types.SimpleNamespace(**{**mlx_lora.CONFIG_DEFAULTS, "train": True, "adapter_path": str(out), **flags})
    seen: dict[str, Any] = {"losses": [], "val": []}

    class Record(TrainingCallback):
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            seen["losses"].append(info["train_loss"])

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            seen["val"].append(info["val_loss"])

    np.random.seed(args.seed)  # as mlx_lm.lora.run
    model, tokenizer = load(args.model)
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    mlx_lora.train_model(args, model, train_set, valid_set, Record())
    seen["weights"] = mx.load(str(out / "adapters.safetensors"))
    return seen


def mlxpipe_lora(hostfile: str, out: Path, *extra: str, **flags: Any) -> list[dict[str, Any]]:
    """Run ``mlxpipe lora --json``; its JSON lines."""
    args = [MLXPIPE, "lora", "--train", "--json", "--hostfile", f"hostfiles/{hostfile}", "--adapter-path", str(out)]
    for key, value in flags.items():
        if value is True:
            args.append("--" + key.replace("_", "-"))
        else:
            args += ["--" + key.replace("_", "-"), str(value)]
    result = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def assert_close(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Equal up to float32 rounding: 1e-4 of the largest value."""
    import mlx.core as mx

    assert sorted(ours) == sorted(theirs)
    largest = max(float(mx.abs(v).max()) for v in theirs.values())
    worst = max(float(mx.abs(ours[k] - theirs[k]).max()) for k in theirs)
    assert worst <= 1e-4 * largest, (worst, largest)


def check_run(lines: list[dict[str, Any]], ref: dict[str, Any], out: Path) -> None:
    import mlx.core as mx

    losses = [line["loss"] for line in lines if line["type"] == "step"]
    assert losses == pytest.approx(ref["losses"], rel=1e-5)
    val = [line["val_loss"] for line in lines if line["type"] == "val"]
    assert val == pytest.approx(ref["val"], rel=1e-5)
    assert_close(mx.load(str(out / "adapters.safetensors")), ref["weights"])


@pytest.fixture(scope="module")
def text_reference(workdir: Path) -> dict[str, Any]:
    return reference(workdir / "ref-text", model=str(workdir / "llama"), data=str(workdir / "text"), **FLAGS)


def test_two_ranks_naive_schedule_equals_mlx_lm_and_writes_its_format(
    workdir: Path, text_reference: dict[str, Any]
) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    out = workdir / "naive"
    lines = mlxpipe_lora("local-2.json", out, model=str(workdir / "llama"), data=str(workdir / "text"), **FLAGS)
    check_run(lines, text_reference, out)
    assert text_reference["losses"][-1] < text_reference["losses"][0]  # it trains
    # Checkpoints as mlx-lm names them, each rank's tensors gathered into one file.
    assert sorted(p.name for p in out.iterdir()) == [
        "0000002_adapters.safetensors", "0000004_adapters.safetensors", "adapter_config.json", "adapters.safetensors",
    ]
    assert_close(mx.load(str(out / "0000004_adapters.safetensors")), text_reference["weights"])
    config = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((workdir / "ref-text" / "adapter_config.json").read_text())
    assert set(theirs) <= set(config)
    for key in ("num_layers", "lora_parameters", "fine_tune_type", "batch_size", "iters", "learning_rate", "seed"):
        assert config[key] == theirs[key], key
    # mlx-lm loads them as its own (mlx_lm.generate --adapter-path does the same).
    model, _ = load(str(workdir / "llama"), adapter_path=str(out))
    loaded = dict(tree_flatten(model.trainable_parameters()))
    assert_close({k: loaded[k] for k in text_reference["weights"]}, text_reference["weights"])
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["iterations"] == FLAGS["iters"]
    assert [r["layers"] for r in summary["ranks"]] == [[2, 4], [0, 2]]  # rank 0 runs the LAST layers
    assert all(r["peak_memory_gb"] > 0 and 0 < r["busy"] <= 1 for r in summary["ranks"])
    plan = lines[0]
    assert plan["type"] == "plan" and [r["layers"] for r in plan["ranks"]] == [[2, 4], [0, 2]]
    assert all(r["frozen_bytes"] > 0 and r["lora_bytes"] > 0 and r["activation_bytes"] > 0 for r in plan["ranks"])
    trains = [line for line in lines if line["type"] == "train"]
    assert len(trains) == FLAGS["iters"] and all(t["tokens_per_second"] > 0 for t in trains)


def test_three_ranks_1f1b_quantized_resumed_equals_mlx_lm_resumed(workdir: Path) -> None:
    """QLoRA: a 4-bit base, resumed from the float run's checkpoint (same adapter shapes)."""
    start = workdir / "naive" / "0000002_adapters.safetensors"
    if not start.exists():
        pytest.skip("needs the two-rank run's checkpoint")
    flags = {**FLAGS, "iters": 3}
    ref = reference(workdir / "ref-resumed", model=str(workdir / "llama-4bit"), data=str(workdir / "text"),
                    resume_adapter_file=str(start), **flags)
    out = workdir / "resumed"
    lines = mlxpipe_lora("local-3.json", out, model=str(workdir / "llama-4bit"), data=str(workdir / "text"),
                         micro_batches=4, schedule="1f1b", resume_adapter_file=str(start), strategy="even", **flags)
    check_run(lines, ref, out)
    # Even split: rank 2 holds layer 0 alone, which --num-layers 3 leaves without adapters: it only runs forward.
    assert [r["layers"] for r in lines[-1]["ranks"]] == [[2, 4], [1, 2], [0, 1]]


def test_moe_chat_data_masked_prompt_gpipe_micro_batches_grad_checkpoint_equals_mlx_lm(workdir: Path) -> None:
    """GPipe with micro-batches and --grad-checkpoint (recomputing activations in the backward changes nothing) on
    an MoE model's chat data with the prompt masked: one launch for all of them (1F1B: the three-rank run)."""
    flags = {**FLAGS, "iters": 3, "mask_prompt": True}
    ref = reference(workdir / "ref-moe", model=str(workdir / "moe"), data=str(workdir / "chat"), **flags)
    out = workdir / "moe-out"
    lines = mlxpipe_lora("local-2.json", out, model=str(workdir / "moe"), data=str(workdir / "chat"),
                         micro_batches=2, schedule="gpipe", grad_checkpoint=True, **flags)
    check_run(lines, ref, out)


def test_a_rank_dying_mid_training_names_it_stops_every_rank_and_keeps_the_checkpoints(workdir: Path) -> None:
    import time

    import mlx.core as mx

    from fixtures import faulty_trainer
    from fixtures.processes import local_rank_processes
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.errors import LaunchError
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.lora.options import TrainOptions
    from mlxpipe.lora.training import Reporter, train

    out = workdir / "dies"
    target = resolve_target(str(workdir / "llama"), None, REPO / "hostfiles" / "local-2.json", None, None, None)
    config = PipelineConfig(target, timeout=60, quiet=True, worker=faulty_trainer.worker(on_rank=1, at_step=3))
    options = TrainOptions.build({"model": str(workdir / "llama"), "train": True, "data": str(workdir / "text"),
                                  "adapter_path": str(out), **FLAGS})
    with pytest.raises(LaunchError) as e:
        train(config, options, Reporter())
    assert e.value.message.startswith("rank 1 on 127.0.0.1: "), e.value.message
    assert "status 3" in e.value.message
    # The checkpoint of step 2 was written whole before the failure, and loads.
    weights = mx.load(str(out / "0000002_adapters.safetensors"))
    assert sorted(weights) == sorted(mx.load(str(out / "adapters.safetensors")))
    assert not (out / "0000004_adapters.safetensors").exists()
    deadline = time.monotonic() + 10
    while local_rank_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert local_rank_processes(os.getpid()) == {}
