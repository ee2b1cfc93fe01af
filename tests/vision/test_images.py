"""A client's image checked before anything reaches a rank: decodable, a supported format, within limits."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from PIL import Image as Pil

from fixtures.vision_models import test_image as picture_bytes
from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Image, Request
from mlxpipe.vision.images import ImageError, ImageLimits, check_image, from_data_uri, read_image_file


def _encoded(kind: str, size: tuple[int, int] = (8, 8)) -> bytes:
    out = io.BytesIO()
    Pil.new("RGB", size, (10, 20, 30)).save(out, format=kind)
    return out.getvalue()


def test_png_becomes_base64_and_its_hash() -> None:
    data = picture_bytes(0)
    image = check_image(data)
    assert base64.b64decode(image.data) == data
    assert image.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_supported_formats(kind: str) -> None:
    assert check_image(_encoded(kind)).sha256


def test_unsupported_format_named() -> None:
    with pytest.raises(ImageError, match="the image is TIFF; supported formats: PNG, JPEG, WEBP, GIF, BMP"):
        check_image(_encoded("TIFF"))


def test_undecodable_and_over_limits() -> None:
    with pytest.raises(ImageError, match="not an image that can be decoded"):
        check_image(b"not a picture")
    with pytest.raises(ImageError, match="over the limit of 10"):
        check_image(picture_bytes(0), ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="64x48 pixels, over the limit of 100"):
        check_image(picture_bytes(0), ImageLimits(max_pixels=100))


def test_data_uri() -> None:
    data = picture_bytes(1)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert from_data_uri(uri).sha256 == hashlib.sha256(data).hexdigest()
    with pytest.raises(ImageError, match="must be a data: URI with base64 data"):
        from_data_uri("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="not valid base64"):
        from_data_uri("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="image URLs are not fetched by this server"):
        from_data_uri("https://example.invalid/a.png")


def test_image_file_errors_name_the_flag() -> None:
    with pytest.raises(UsageError, match=r"--image /nonexistent\.png: No such file or directory"):
        read_image_file("/nonexistent.png")


def test_images_cross_the_wire() -> None:
    image = check_image(picture_bytes(0))
    request = Request(tokens=[1, 2], images=(image,), vision_prompt="text")
    back = Request.from_wire(request.to_wire())
    assert back.images == (image,) and isinstance(back.images[0], Image) and back.vision_prompt == "text"
