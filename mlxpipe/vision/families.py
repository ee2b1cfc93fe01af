"""Which vision-language families mlxpipe runs across the ranks, and why it refuses the others: by mlx-vlm model type.

The controller reads this table before launch (``check_family``), so a family the pipeline cannot split is refused
in one line, naming its model type and the reason, before any rank starts (the ranks still check what a model's
embeddings hand its language model as they load: the backstop for a type the table does not name).
docs/architectures.md's vision table is generated from it (``python -m mlxpipe.vision.families``);
tests/vision/test_families.py checks the doc, and the refusals against the installed mlx-vlm's sources.

Pure data and text: importing this module imports neither mlx nor mlx-vlm.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from mlxpipe.errors import ModelError, UsageError

# Token-identical to single-process mlx-vlm at 2 ranks (tests/e2e/test_vision.py, on the tiny random checkpoints
# of tests/fixtures/vision_models.py); Gemma 3, Kimi-VL, Mistral 3 and Qwen2.5-VL at --tp 2 and 2 stages x --tp 2
# too, Qwen3-VL at --tp 2. With --tp, those of NO_TENSOR_PARALLEL are refused.
RUNS: dict[str, str] = {
    "gemma3": "Gemma 3",
    "kimi_k25": "Kimi K2.5 (Kimi-VL's vision tower, a DeepSeek-V3 language model)",
    "kimi_vl": "Kimi-VL (a mixture-of-experts language model)",
    "llama4": "Llama 4 (interleaved mixture-of-experts, chunked attention; its image tiles pixel-shuffled)",
    "mistral3": "Mistral 3 (a Pixtral vision tower)",
    "qwen2_5_vl": "Qwen2.5-VL (multi-axis rotary positions, carried across stages)",
    "qwen3_5": "Qwen3.5 (gated-delta linear attention between full-attention layers; Qwen3-VL's vision tower)",
    "qwen3_5_moe": "Qwen3.5's mixture-of-experts models",
    "qwen3_vl": "Qwen3-VL (deepstack features, added in its first layers, all on the first stage)",
    "qwen3_vl_moe": "Qwen3-VL's mixture-of-experts models (deepstack features as Qwen3-VL's)",
}

# Families that run as a pipeline but not with --tp: mlx-vlm's models have no shard() of their own, and the generic
# tensor-parallel sharder does not split these parts of them (the ranks would refuse it after launch).
NO_TENSOR_PARALLEL: dict[str, str] = {
    "llama4": "its experts' router (feed_forward.router)",
    "qwen3_5": "its gated-delta layers (linear_attn)",
    "qwen3_5_moe": "its gated-delta layers (linear_attn) and shared expert's gate",
}

# Families whose language model adds the vision tower's deepstack features (with the image tokens' mask) to the
# hidden state after each of its first k layers, k the vision config's deepstack layers: those features never
# cross a cut when the first stage (the highest rank) holds layers 0..k, which any sensible split of a real model
# does (Qwen3-VL: k = 3 of 28 or more layers); ``check_deepstack`` refuses a split that does not.
DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")
DEEPSTACK_FEATURES = ("visual_pos_masks", "deepstack_visual_embeds")

# What a language model may read from mlx-vlm's ``get_input_embeddings`` besides the embeddings and position ids,
# none of which crosses a pipeline cut or reaches a later stage's layers; in the words of the refusal.
FEATURE_REASONS: dict[str, str] = {
    "deepstack_visual_embeds": "deepstack features",
    "visual_pos_masks": "the image tokens' mask",
    "per_layer_inputs": "per-layer inputs",
    "cross_attention_states": "cross-attention states",
    "cross_attention_mask": "cross-attention masks",
    "full_text_row_masked_out_mask": "cross-attention masks",
    "decoder_inputs_embeds": "an encoder-decoder's decoder inputs",
    "attention_mask_4d": "a 4-d attention mask",
    "pos_hw": "2-d patch positions",
}

# The vision families of mlx-vlm 0.7.10 whose language model reads some of these (a word its source names):
# the test compares this with the installed mlx-vlm's sources.
READS: dict[str, tuple[str, ...]] = {
    "cohere_compass": ("visual_pos_masks", "deepstack_visual_embeds"),
    "embedding_gemma2": ("per_layer_inputs",),
    "falcon_ocr": ("attention_mask_4d", "pos_hw"),
    "falcon_perception": ("cross_attention_states", "pos_hw"),
    "florence2": ("cross_attention_states", "decoder_inputs_embeds"),
    "gemma3n": ("per_layer_inputs",),
    "gemma4": ("per_layer_inputs",),
    "granite4_vision": ("visual_pos_masks", "deepstack_visual_embeds"),
    "minimax_m3_vl": ("visual_pos_masks",),
    "mllama": ("cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask"),
    "nemotron_parse": ("cross_attention_states", "decoder_inputs_embeds"),
    "qwen3_omni_moe": ("visual_pos_masks", "deepstack_visual_embeds"),
    "qwen3_vl": ("visual_pos_masks", "deepstack_visual_embeds"),
    "qwen3_vl_moe": ("visual_pos_masks", "deepstack_visual_embeds"),
    "zaya1_vl": ("visual_pos_masks",),
}

# Refused for what happens outside the pipeline.
REFUSED_OTHERWISE: dict[str, str] = {
    "llava": "mlx-vlm 0.7.10 cannot run it either: its LLaVA processor hands `padding` to transformers 5's image "
             "processor, which refuses it",
}

REFUSED_HINT = "run it on one machine with mlx-vlm, or pick a family docs/architectures.md lists as running"


def reason_of(reads: tuple[str, ...]) -> str:
    """The refusal of a family whose language model reads ``reads``."""
    said = list(dict.fromkeys(FEATURE_REASONS[f] for f in reads))
    return (f"its language model reads {', '.join(said)} ({', '.join(reads)}) inside its layers, which the pipeline "
            "does not carry past the first stage")


def refused() -> dict[str, str]:
    """Every refused model type and its reason (a deepstack family that runs reads its features on the first stage)."""
    table = {t: reason_of(reads) for t, reads in READS.items() if t not in RUNS}
    table.update(REFUSED_OTHERWISE)
    return dict(sorted(table.items()))


def status(model_type: str) -> str:
    """``runs``, ``refused`` or ``untested`` (not in the table: the ranks check it as they load)."""
    if model_type in RUNS:
        return "runs"
    return "refused" if model_type in refused() else "untested"


def family_type(config: dict[str, Any]) -> str:
    """The mlx-vlm model type of ``config``, remapped as mlx-vlm remaps it (``cohere2_vision`` -> ``aya_vision``)."""
    model_type = str(config.get("model_type", "")).lower()
    return _mlx_vlm_remapping().get(model_type, model_type)


def check_family(config: dict[str, Any]) -> None:
    """Raise ModelError, naming the model type and why, if the table refuses this vision-language model."""
    model_type = family_type(config)
    reason = refused().get(model_type)
    if reason is not None:
        raise ModelError(f"{model_type}: mlxpipe cannot split this vision-language model: {reason}",
                         hint=REFUSED_HINT)


def check_tensor_parallel(config: dict[str, Any], tp: int) -> None:
    """Raise UsageError, naming the flag and the model type, if ``tp`` > 1 and the sharder cannot split the family."""
    model_type = family_type(config)
    what = NO_TENSOR_PARALLEL.get(model_type)
    if tp > 1 and what is not None:
        raise UsageError(f"--tp {tp}: {model_type}: the tensor-parallel sharder cannot split mlx-vlm's model: {what}",
                         hint="run it as a pipeline: drop --tp")


def deepstack_layers(config: dict[str, Any]) -> int:
    """How many first layers of a deepstack family's language model read the deepstack features (0: none)."""
    if family_type(config) not in DEEPSTACK:
        return 0
    return len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ())


def check_deepstack(config: dict[str, Any], split: Sequence[int]) -> None:
    """Raise UsageError, naming the model type and the split to change, if the first stage (the highest rank, the
    split's last entry) does not hold every layer that reads the deepstack features and the layer after them: the
    last layer a stage holds hands its output on before the model adds the features to it."""
    k = deepstack_layers(config)
    if len(split) == 1 or split[-1] > k:
        return
    layers = "layer 0" if k == 1 else f"layers 0-{k - 1}"
    raise UsageError(
        f"{family_type(config)}: its language model adds the vision tower's deepstack features after {layers}, "
        f"which must run on the first stage (the highest rank) with the layer after them: it needs {k + 1} layers, "
        f"the split gives it {split[-1]}",
        hint=f"give the last --split entry at least {k + 1} layers",
    )


@cache
def _mlx_vlm_remapping() -> dict[str, str]:
    """mlx_vlm/utils.py's MODEL_REMAPPING, read from its source (importing it would import mlx); empty without it."""
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    source = Path(next(iter(spec.submodule_search_locations))) / "utils.py"
    if not source.is_file():
        return {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING"
                                                for t in node.targets):
            table: dict[str, str] = ast.literal_eval(node.value)
            return table
    return {}


# --- docs/architectures.md's vision table ------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
TABLE_BEGIN = "<!-- vision families: generated by python -m mlxpipe.vision.families -->"
TABLE_END = "<!-- end of vision families -->"


def table() -> str:
    """The vision table: the families that run, then the refused ones with their reasons."""
    refusals = refused()
    lines = [
        TABLE_BEGIN,
        "",
        f"{len(RUNS)} vision-language families run across the ranks, token-identical to single-process mlx-vlm; "
        f"{len(refusals)} are refused before launch with the reason below. Any other mlx-vlm model type is "
        "untested: the ranks load it, and refuse it there if its language model reads from the vision tower "
        "what the pipeline does not carry.",
        "",
        "| mlx-vlm model type | status |",
        "|---|---|",
    ]
    lines += [f"| {t} | runs: {what}{_tp_note(t)} |" for t, what in sorted(RUNS.items())]
    lines += [f"| {t} | refused: {why} |" for t, why in refusals.items()]
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _tp_note(model_type: str) -> str:
    what = NO_TENSOR_PARALLEL.get(model_type)
    return "" if what is None else f"; not with --tp (the sharder cannot split {what})"


def table_section(text: str) -> str | None:
    """The generated table in a page's text, None when absent."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return None
    return text[text.index(TABLE_BEGIN) : text.index(TABLE_END) + len(TABLE_END)]


def write_table(doc: Path = DOC) -> None:
    """Put the table in ``doc`` in place of the old one (or at its end, the first time)."""
    text = doc.read_text()
    old = table_section(text)
    generated = table()
    doc.write_text(text.replace(old, generated) if old is not None else text.rstrip("\n") + "\n\n" + generated + "\n")


if __name__ == "__main__":
    write_table()
