"""A vision-language model's prompts in the engine: the first stage's image features, what each micro-batch
hands the language model besides its tokens, the position ids that cross the cuts, the prompt cache's keys.

The first stage (the highest rank, which holds the embeddings) alone runs the vision tower: ``features``
gives a prompt's input embeddings and position ids, as ``mlx_vlm.generate`` computes them; its position ids
travel with the hidden state to the later stages (``pack_positions``), which never see the pixels. Qwen3-VL's
deepstack features, added to the hidden state after its first few layers, never leave the first stage: those
layers are there (``mlxpipe.vision.families.check_deepstack``), and ``deepstack_inputs`` hands them each
micro-batch's share. ``VisionInputs`` keeps the engine's prompts and makes each micro-batch's inputs. The model
itself, behind mlx-lm's interface, is ``worker.vision``'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.errors import ModelError
from mlxpipe.protocol.request import Image, Request
from mlxpipe.worker.generation.schedule import MicroBatch

_POSITION_AXES = 3  # Qwen-VL's multi-axis rotary positions: time, height, width


@dataclass
class PromptFeatures:
    """One prompt's inputs to the language model, on the first stage."""

    embeddings: mx.array  # (1, prompt tokens, hidden)
    positions: mx.array | None  # (3, 1, prompt tokens) int32, for models that take position ids
    delta: int  # positions past the prompt: index + delta (Qwen-VL's rope deltas)
    # Qwen3-VL's deepstack: where the prompt's image tokens are, and per deepstack layer their features
    # (image tokens, hidden), in the prompt's order. None for other models and prompts without images.
    visual: list[int] | None = None
    deepstack: list[mx.array] | None = None


def features(model: nn.Module, processor: Any, config: dict[str, Any], request: Request,
             tokens: list[int]) -> PromptFeatures:
    """The prompt's input embeddings (its images merged in by the vision tower) and position ids.

    The processor runs on the prompt text the controller tokenized, as ``mlx_vlm.generate`` runs it; its
    token ids must be the ones every rank was sent. A resumed request's reply so far (its last ``resumed`` tokens)
    is no part of them: those are embedded as replies are (``VisionInputs.inputs``).
    """
    tokens = tokens[: len(tokens) - request.resumed]
    kwargs: dict[str, Any] = {}
    pixel_values = None
    if request.images:
        from mlxpipe.vision.prompt import process

        inputs = process(processor, config, request.vision_prompt or "", request.images)
        ids = inputs.pop("input_ids")
        if [int(t) for t in ids.reshape(-1).tolist()] != tokens:
            raise ModelError("the image processor on the first stage tokenized the prompt differently from the "
                             "controller", hint="install the same mlx-vlm and transformers on every host")
        pixel_values = inputs.pop("pixel_values", None)
        kwargs = {k: v for k, v in inputs.items() if v is not None and k != "attention_mask"}
        kwargs["mask"] = inputs.get("attention_mask")
    input_ids = mx.array([tokens], mx.int32)
    out = model.get_input_embeddings(input_ids, pixel_values, **kwargs)
    positions = getattr(out, "position_ids", None)
    deltas = getattr(out, "rope_deltas", None)
    # One request: one delta (``item`` is typed as any scalar; the int32 array's is an int).
    delta = cast(int, mx.array(deltas).reshape(-1)[0].astype(mx.int32).item()) if deltas is not None else 0
    if positions is not None:
        positions = positions.astype(mx.int32)
        if positions.ndim == 2:  # a prompt without images: (1, tokens), the same position on every axis
            positions = mx.broadcast_to(positions[None], (_POSITION_AXES, *positions.shape))
        mx.eval(out.inputs_embeds, positions)
    else:
        mx.eval(out.inputs_embeds)
    deepstack = getattr(out, "deepstack_visual_embeds", None)
    if deepstack is None:
        return PromptFeatures(out.inputs_embeds, positions, delta)
    mask = out.visual_pos_masks.reshape(-1).tolist()
    visual = [i for i, is_image in enumerate(mask) if is_image]
    return PromptFeatures(out.inputs_embeds, positions, delta, visual, [deepstack[k] for k in range(len(deepstack))])


def deepstack_inputs(rows: Sequence[tuple[PromptFeatures | None, int]], width: int) -> dict[str, Any]:
    """The deepstack keywords of a micro-batch on the first stage, as mlx-vlm's language model reads them: each
    row's image-token mask over its tokens ``start`` .. ``start + width``, and those tokens' features row after
    row. Empty where no row has an image token there (the language model then adds nothing)."""
    masks, picked = [], []
    for prompt, start in rows:
        mask = [False] * width
        if prompt is not None and prompt.visual is not None and prompt.deepstack is not None:
            inside = [i for i, p in enumerate(prompt.visual) if start <= p < start + width]
            for i in inside:
                mask[prompt.visual[i] - start] = True
            if inside:
                picked.append([layer[inside[0] : inside[-1] + 1] for layer in prompt.deepstack])
        masks.append(mask)
    if not picked:
        return {}
    layers = [mx.concatenate([features[k] for features in picked]) for k in range(len(picked[0]))]
    return {"visual_pos_masks": mx.array(masks), "deepstack_visual_embeds": layers}


def text_embeddings(model: nn.Module, tokens: mx.array) -> mx.array:
    """Input embeddings of tokens without images, as mlx-vlm makes them."""
    embeddings: mx.array = model.get_input_embeddings(tokens).inputs_embeds
    return embeddings


def positions_of(prompt: PromptFeatures | None, start: int, width: int) -> mx.array:
    """Position ids (3, 1, width) of the tokens ``start`` .. ``start + width`` of a request."""
    length = prompt.positions.shape[-1] if prompt is not None and prompt.positions is not None else 0
    delta = prompt.delta if prompt is not None else 0
    parts = []
    if start < length:
        assert prompt is not None and prompt.positions is not None
        parts.append(prompt.positions[:, :, start : min(start + width, length)])
    after = start + width - max(start, length)
    if after > 0:
        first = max(start, length)
        steps = mx.arange(first, first + after, dtype=mx.int32) + delta
        parts.append(mx.broadcast_to(steps[None, None, :], (_POSITION_AXES, 1, after)))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def pack_positions(hidden: mx.array, positions: mx.array) -> mx.array:
    """The hidden state (batch, tokens, ...) and the position ids (3, batch, tokens) as one uint8 message:
    one send, so the two never cross in another order."""
    batch, tokens = positions.shape[1:]
    data = mx.contiguous(hidden).view(mx.uint8).reshape(batch, tokens, -1)
    ids = mx.contiguous(positions.astype(mx.int32).transpose(1, 2, 0)).view(mx.uint8).reshape(batch, tokens, -1)
    return mx.concatenate([data, ids], axis=2)


POSITION_BYTES = _POSITION_AXES * 4  # per token


def unpack_positions(message: mx.array, shape: tuple[int, ...], dtype: Any) -> tuple[mx.array, mx.array]:
    """``pack_positions``' message back: the hidden state of ``shape`` and ``dtype``, and the position ids."""
    batch, tokens = message.shape[:2]
    hidden = message[:, :, :-POSITION_BYTES]
    ids = message[:, :, -POSITION_BYTES:]
    hidden = mx.contiguous(hidden).view(dtype).reshape(shape)
    positions = mx.contiguous(ids).view(mx.int32).reshape(batch, tokens, _POSITION_AXES).transpose(2, 0, 1)
    return hidden, positions


# --- the prompt cache's keys ---------------------------------------------------------


def image_token_of(config: dict[str, Any]) -> int | None:
    """A vision-language model's image placeholder token, as its config names it."""
    for key in ("image_token_id", "image_token_index", "media_placeholder_token_id"):
        value = config.get(key)
        if isinstance(value, int):
            return value
    return None


def cache_key(tokens: Sequence[int], images: Sequence[Image], image_token: int) -> list[int]:
    """``tokens`` with each image's run of placeholder tokens replaced by a mark of that image's hash (a negative
    id, which no token has). Where the runs are not one per image (a family that breaks an image into rows),
    every placeholder is marked by the hash of all the images."""
    marks = [_mark(image.sha256) for image in images]
    runs = _runs(tokens, image_token)
    if len(runs) != len(marks):
        marks = [_mark(hashlib.sha256("".join(image.sha256 for image in images).encode()).hexdigest())]
        runs = [[i for run in runs for i in run]]
    key = list(tokens)
    for run, mark in zip(runs, marks, strict=True):
        for i in run:
            key[i] = mark
    return key


def _mark(digest: str) -> int:
    return -1 - int(digest[:15], 16)


def _runs(tokens: Sequence[int], token: int) -> list[list[int]]:
    """The positions of each run of ``token`` in ``tokens``."""
    runs: list[list[int]] = []
    for i, t in enumerate(tokens):
        if t != token:
            continue
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


# --- the engine's prompts -------------------------------------------------------------


class VisionInputs:
    """A vision-language model's prompts on one stage of the engine: the first stage keeps each prompt's features
    (run through the vision tower once, as the request arrives) and hands each micro-batch its rows' share; the
    later stages hand it the position ids that came with its hidden state."""

    def __init__(self, model: nn.Module, processor: Any, config: dict[str, Any], first: bool, positions: bool) -> None:
        """``first``: this is the first stage (it holds the vision tower); ``positions``: the language model takes
        position ids (they cross the cuts)."""
        self.model, self.processor, self.config = model, processor, config
        self.first, self.positions = first, positions
        self.prompts: dict[int, PromptFeatures] = {}  # the first stage's, by request index
        self.image_token = image_token_of(config)

    def add(self, index: int, request: Request, prompt: list[int]) -> None:
        """The first stage: ``request``'s prompt (its tokens) through the vision tower, once."""
        self.prompts[index] = features(self.model, self.processor, self.config, request, prompt)

    def drop(self, index: int) -> None:
        """A request ended: its features go."""
        self.prompts.pop(index, None)

    def inputs(self, batch: MicroBatch, tokens: mx.array, positions_in: mx.array | None) -> dict[str, Any]:
        """What a micro-batch (its ``tokens``) hands the language model besides its tokens: on the first stage, the
        prompt's embeddings (its images merged in) where its rows read the prompt (and their deepstack features),
        and the position ids; on the later stages, the position ids that came with the hidden state
        (``positions_in``)."""
        extra: dict[str, Any] = {}
        if not self.first:
            if self.positions:
                extra["position_ids"] = positions_in
            return extra
        rows = list(zip(batch.requests, batch.starts, strict=True))
        if self.positions:
            extra["position_ids"] = mx.concatenate(
                [positions_of(self.prompts.get(i), start, batch.width) for i, start in rows], axis=1)
        if any(start < self.prompts[i].embeddings.shape[1] for i, start in rows if i in self.prompts):
            embeddings = []
            for row, (i, start) in enumerate(rows):
                prompt = self.prompts.get(i)
                if prompt is not None and start < prompt.embeddings.shape[1]:
                    part = prompt.embeddings[:, start : start + batch.width]
                    if part.shape[1] < batch.width:  # a resumed request: its reply so far follows the prompt
                        rest = text_embeddings(self.model, tokens[row : row + 1, part.shape[1] :])
                        part = mx.concatenate([part, rest.astype(part.dtype)], axis=1)
                    embeddings.append(part)
                else:  # a reply's token: embedded as the language model would embed it
                    embeddings.append(text_embeddings(self.model, tokens[row : row + 1]))
            extra["input_embeddings"] = mx.concatenate(embeddings, axis=0)
            extra.update(deepstack_inputs([(self.prompts.get(i), start) for i, start in rows], batch.width))
        return extra

    def cache_key(self, request: Request, tokens: Sequence[int]) -> list[int]:
        """The prompt cache's key of ``tokens``: with images, each image's placeholder tokens made its own
        (``cache_key``), so that only the same picture reuses a cached prefix."""
        if not request.images or self.image_token is None:
            return list(tokens)
        return cache_key(tokens, request.images, self.image_token)
