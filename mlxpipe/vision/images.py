"""An image a client sends, checked before anything reaches a rank: decodable, a supported format, within limits.

Pure Pillow (no MLX): the doors and the command line call ``check_image`` on the bytes they got, and a bad image
is a ``ImageError`` naming what is wrong, which each door turns into a 400 in its own shape.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

from mlxpipe.defaults import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES
from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Image

# The formats a client may send: those Pillow decodes and mlx-vlm's processors take.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(UsageError):
    """An image the server refuses: undecodable, of an unsupported format, or over a limit."""


@dataclass(frozen=True)
class ImageLimits:
    """The limits every image of a request is checked against."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES


def check_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image:
    """``data`` as a request's image, once it decodes as a supported format within the limits."""
    from PIL import Image as Pil
    from PIL import UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        with Pil.open(io.BytesIO(data)) as picture:
            kind = picture.format or "unknown"
            if kind not in FORMATS:
                raise ImageError(f"the image is {kind}; supported formats: {', '.join(FORMATS)}")
            width, height = picture.size
            if width * height > limits.max_pixels:
                raise ImageError(f"the image is {width}x{height} pixels, over the limit of {limits.max_pixels}")
            picture.load()
    except Pil.DecompressionBombError as e:  # Pillow's own guard, far above the limit: refused before decoding
        raise ImageError(f"the image is over the limit of {limits.max_pixels} pixels") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError("the image data is not an image that can be decoded") from e
    return Image(data=base64.b64encode(data).decode(), sha256=hashlib.sha256(data).hexdigest())


def decode_base64(text: str) -> bytes:
    """Base64 text (whitespace allowed) as bytes; ``ImageError`` when it is not base64."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError("the image data is not valid base64") from e


def from_data_uri(uri: str, limits: ImageLimits = ImageLimits()) -> Image:
    """An image from a ``data:image/...;base64,...`` URI. An http(s) URL left here was not fetched (the server
    fetches only with ``--allow-image-urls``, before parsing): refused, naming the flag."""
    if uri.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched by this server without --allow-image-urls: send the image "
                         "inline as a data: URI, or restart mlxpipe serve with --allow-image-urls")
    head, sep, body = uri.partition(",")
    if not uri.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ImageError("an image URL must be a data: URI with base64 data (data:image/png;base64,...)")
    return check_image(decode_base64(body), limits)


def read_image_file(path: str, limits: ImageLimits = ImageLimits()) -> Image:
    """An image file from the command line (``--image PATH``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"--image {path}: {e.strerror or e}") from e
    try:
        return check_image(data, limits)
    except ImageError as e:
        raise UsageError(f"--image {path}: {e.message}") from e
