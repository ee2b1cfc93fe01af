"""plan/training.py: the LoRA memory estimate, against the adapters mlx-lm makes."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize(("model", "num_layers", "keys"), [("llama", 3, None), ("llama-4bit", 2, None),
                                                           ("moe", -1, None), ("llama", 4, ["self_attn.q_proj"])])
def test_the_memory_estimate_counts_the_adapters_mlx_lm_makes(workdir: Path, model: str, num_layers: int,
                                                              keys: list[str] | None) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    from mlxpipe.model.metadata import load_local
    from mlxpipe.plan.training import lora_parameters_of

    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    loaded, _ = load(str(workdir / model))
    loaded.freeze()
    linear_to_lora_layers(loaded, num_layers, lora)
    made = sum(v.size for _, v in tree_flatten(loaded.trainable_parameters()))
    meta = load_local(workdir / model)
    first = 0 if num_layers < 0 else 4 - num_layers
    assert sum(lora_parameters_of(meta, i, 4, keys) for i in range(first, 4)) == made


def test_the_memory_estimate_holds_the_micro_batches_in_flight_and_the_backward_working_set(workdir: Path) -> None:
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.lora.options import TrainOptions
    from mlxpipe.model.metadata import load_local
    from mlxpipe.plan.shard import make_plan
    from mlxpipe.plan.training import training_memory

    meta = load_local(workdir / "llama")
    the_plan = make_plan(meta, load_hostfile(Path("hostfiles/local-2.json")).hosts)  # rank 1: layers 0-1

    def rank1(schedule: str, micro: int, num_layers: int = -1) -> tuple[int, int]:
        options = TrainOptions.build({"model": str(workdir / "llama"), "train": True, "batch_size": 8,
                                      "micro_batches": micro, "schedule": schedule, "num_layers": num_layers})
        m = training_memory(meta, the_plan, options, 40)[1]  # the first stage: no logits
        return m.micro_batches_held, m.activation_bytes

    # In units of one layer's activations for one 2-row micro-batch (L): held micro-batches x
    # 2 layers, plus the backward's working set, one layer of one micro-batch.
    gpipe, one_f_one_b, naive = rank1("gpipe", 4), rank1("1f1b", 4), rank1("1f1b", 1)
    assert (gpipe[0], one_f_one_b[0], naive[0]) == (4, 2, 1)
    assert gpipe[1] / one_f_one_b[1] == pytest.approx(9 / 5)  # 8L + L against 4L + L
    assert naive[1] / gpipe[1] == pytest.approx(12 / 9)  # one 8-row micro-batch: 2 x 4L + 4L
    # Only the last layer trained: the first stage runs forward only, one micro-batch, no backward.
    forward_only = rank1("1f1b", 4, num_layers=1)
    assert forward_only[0] == 1 and forward_only[1] / one_f_one_b[1] == pytest.approx(2 / 5)
