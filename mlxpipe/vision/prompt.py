"""A request with images as token ids, by mlx-vlm's own chat template and processor, on the controller.

The number of placeholder tokens an image becomes depends on its size (the processor expands each image's
marker), and every rank must schedule the same tokens: so the controller tokenizes, exactly as
``mlx_vlm.generate`` does, and sends the ids with the images and the text it processed (``vision_prompt``).
"""

from __future__ import annotations

import base64
import importlib.util
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Image, Request

NEEDS_VISION = "images need mlx-vlm, which this install lacks"
VISION_HINT = "pip install 'mlxpipe[vision]'"


def vision_installed() -> bool:
    """Whether mlx-vlm can be imported here."""
    return importlib.util.find_spec("mlx_vlm") is not None


def require_vision() -> None:
    """Raise the one-line refusal of a text-only install given an image."""
    if not vision_installed():
        raise UsageError(NEEDS_VISION, hint=VISION_HINT)


def is_vision_config(config: dict[str, Any]) -> bool:
    """Whether a model's config is a vision-language model's (a vision tower's config beside the text's)."""
    return isinstance(config.get("vision_config"), dict)


def pil_images(images: tuple[Image, ...]) -> list[Any]:
    """The request's images as PIL images."""
    from PIL import Image as Pil

    pictures = []
    for image in images:
        picture = Pil.open(io.BytesIO(base64.b64decode(image.data)))
        picture.load()
        pictures.append(picture)
    return pictures


def process(processor: Any, config: dict[str, Any], text: str, images: tuple[Image, ...]) -> dict[str, Any]:
    """mlx-vlm's ``prepare_inputs`` on ``text`` and ``images``, with ``mlx_vlm.generate``'s arguments."""
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    return dict(prepare_inputs(  # type: ignore[no-untyped-call]  # mlx-vlm is unannotated
        processor, images=pil_images(images) or None, prompts=text,
        image_token_index=config.get("image_token_index"),
        add_special_tokens=should_add_special_tokens(config.get("model_type", ""), processor),
    ))


class VisionPrompt:
    """The controller's processor of one vision-language model: a request's prompt and images as token ids."""

    def __init__(self, model_dir: Path, config: dict[str, Any]) -> None:

        self.config = config
        self.processor = load_vision_processor(model_dir)

    def text(self, request: Request, tools: list[Any] | None = None) -> str:
        """The prompt through the chat template, each image marked where the family marks it.

        ``tools`` and the request's template variables (``chat_template_config``: the thinking switch, a
        ``tool_choice``) reach the template as mlx-vlm's own server gives them to it, as ``get_chat_template``'s
        keywords; the system prompt and a prefill (``prefill_response``, continued) as the text path's
        (``prompts.prompt_tokens``)."""
        from mlx_vlm.prompt_utils import apply_chat_template, get_chat_template

        extra: dict[str, Any] = dict(request.chat_template_config or {})
        if tools:
            extra["tools"] = tools
        if request.messages is None:
            if request.prompt is None:
                raise UsageError("a request with images needs a prompt or messages")
            return str(apply_chat_template(self.processor, self.config, request.prompt,
                                           num_images=len(request.images), **extra))
        messages = _parts(request.messages)
        if request.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": request.system_prompt})
        prefill = request.prefill_response is not None
        if prefill:
            # The template writes the turn, and transformers cuts it after the prefill's text: the reply goes on.
            messages.append({"role": "assistant", "content": request.prefill_response})
            extra["continue_final_message"] = True
        return str(get_chat_template(self.processor, messages, not prefill, **extra))

    def tokenize(self, request: Request, tools: list[Any] | None = None) -> Request:
        """``request`` with its prompt as token ids and the text the processor expanded (``vision_prompt``);
        ``tools``: the function tools the template lists."""
        text = self.text(request, tools)
        inputs = process(self.processor, self.config, text, request.images)
        tokens = [int(t) for t in inputs["input_ids"].reshape(-1).tolist()]
        return replace(request, prompt=None, messages=None, tokens=tokens, vision_prompt=text)


def _parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose images are ``{"type": "image"}`` parts (the doors keep them so), text as text parts."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = [p if p.get("type") == "image" else {"type": "text", "text": p.get("text", "")} for p in content]
            out.append({**message, "content": parts})
        else:
            out.append(message)
    return out


def load_vision_processor(path: Path) -> Any:
    """mlx-vlm's processor of the checkpoint at ``path``, as ``mlx_vlm.load`` makes it."""
    from mlx_vlm.utils import get_model_and_args, load_config, load_image_processor, load_processor

    config = load_config(path)
    # Importing the family's module first, as ``mlx_vlm.load`` does by loading the model: it registers the
    # family's own processor classes (without them transformers may pick ones that need PyTorch).
    get_model_and_args(dict(config))
    processor = load_processor(path, True, eos_token_ids=config.get("eos_token_id"))
    image_processor = load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor
    return processor
