"""A vision-language model on a rank: mlx-vlm's model behind mlx-lm's interface.

mlx-vlm splits each model into a vision tower and projector (``get_input_embeddings``: the prompt's images
turned into input embeddings merged with the text's) and a language model whose blocks the generic pipeline
cuts like any mlx-lm model's. ``load_vision_rank`` loads the model with mlx-vlm's own loader; the class
swap of ``as_language_model`` makes ``model(tokens, cache=...)`` return the language model's logits, with
the input embeddings and (Qwen-VL's multi-axis rotary) position ids a micro-batch brings. Only the first
stage (the highest rank, which holds the embeddings) keeps the vision tower (``vision_modules``); what its
language model reads besides its tokens, and whether the pipeline carries it, is checked at load
(``unsupported_features``, ``needs_positions``).

What a prompt's images become on the first stage, and what crosses the cuts with the hidden state, is the
generation room's (``generation.vision_inputs``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# What mlx-vlm's ``get_input_embeddings`` may hand the language model besides the embeddings, and which of it
# mlxpipe carries: position ids (rope deltas say how they go on after the prompt). Anything else a language
# model reads (deepstack features, per-layer inputs, cross-attention states) the pipeline does not carry.
CARRIED_FEATURES = ("inputs_embeds", "position_ids", "rope_deltas")
# What the language model reads only in layers the first stage holds (Qwen3-VL's deepstack: after its first k
# layers), so nothing of it crosses a cut; the controller refuses a split that would put one of those layers (or
# the one after them) on a later stage, and so does ``load_vision_rank``.
FIRST_STAGE_FEATURES = ("visual_pos_masks", "deepstack_visual_embeds")
# ``attention_mask`` is an encoder-decoder model's (mlx-vlm's own comment); decoder-only language models name the
# word only for the processor's padding mask, which a prompt of one request does not have.
_IGNORED_FEATURES = ("attention_mask",)


def load_vision_model(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-vlm's model of the checkpoint at ``path``, lazily, from the weight files there (a rank's share)."""
    from mlx_vlm.utils import load_config, load_model

    model = load_model(path, lazy=True, strict=False)
    return as_language_model(model), load_config(path)


class _LanguageCall:
    """Put in front of mlx-vlm's model class: mlx-lm's call (tokens and caches in, logits out)."""

    language_model: nn.Module

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None,
                 position_ids: mx.array | None = None, **first_stage: Any) -> mx.array:
        """``first_stage``: what only the first stage's layers read (``deepstack_inputs``)."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **kwargs, **first_stage)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits

    def make_cache(self) -> list[Any]:
        """The language model's caches, as mlx-vlm's generate makes them."""
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.language_model)


_CLASSES: dict[type, type] = {}


def as_language_model(model: nn.Module) -> nn.Module:
    """``model`` with ``_LanguageCall`` in front of its class (its weights and attributes unchanged)."""
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_LanguageCall, cls), {})
    model.__class__ = _CLASSES[cls]
    return model


def is_vision_model(model: nn.Module) -> bool:
    return isinstance(model, _LanguageCall)


def vision_modules(model: nn.Module) -> list[str]:
    """The model's parts outside the language model: the vision tower, projector (and any other tower)."""
    return [key for key, value in model.items() if isinstance(value, nn.Module) and key != "language_model"]


def unsupported_features(model: nn.Module, model_type: str) -> list[str]:
    """What this model's embeddings hand its language model that the pipeline does not carry (empty: none)."""
    from mlx_vlm.models.base import InputEmbeddingsFeatures

    from mlxpipe.vision.families import DEEPSTACK

    carried = CARRIED_FEATURES + (FIRST_STAGE_FEATURES if model_type in DEEPSTACK else ())
    names = [f for f in InputEmbeddingsFeatures.__dataclass_fields__
             if f not in carried and f not in _IGNORED_FEATURES]
    # A feature the language model's code never names is one it never reads (Gemma 3's 4-d mask).
    module = inspect.getmodule(type(model.language_model))
    source = inspect.getsource(module) if module is not None else ""
    return [name for name in names if name in source]


def needs_positions(model: nn.Module) -> bool:
    """Whether the language model takes position ids the embeddings compute (Qwen-VL's multi-axis rotary)."""
    features = model.get_input_embeddings(mx.array([[1, 2]], mx.int32))
    return getattr(features, "position_ids", None) is not None
