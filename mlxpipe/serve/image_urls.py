"""Image URLs a body sends, fetched by the server (``--allow-image-urls``) before the body is parsed.

OpenAI Chat's ``image_url`` parts, Responses' ``input_image`` parts and Anthropic's ``url`` image sources may
name an ``http(s)`` image instead of carrying it. With the flag, each is fetched here, at most the image limit's
bytes within ``--image-url-timeout`` seconds, and put in the body in its place, inline (a ``data:`` URI, a
``base64`` source): the doors then check and tokenize it as any image a client sent inline. Fetching happens
before parsing, asynchronously, so a slow image server holds up only its own request, never the event loop.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import httpx

from mlxpipe.serve.door import ApiError

if TYPE_CHECKING:
    from mlxpipe.serve.door import ServerSettings

# The body's fields that hold the messages, in each door that takes image URLs.
_MESSAGE_FIELDS = ("messages", "input")
_MAX_REDIRECTS = 5


@dataclass
class _Url:
    """One image URL of the body: where it is (the door's name of its part), and how to put the image there."""

    url: str
    where: str
    put: Callable[[bytes, str], None]  # (the image's bytes, its media type)


class _FetchFailed(Exception):
    """An image URL that gave no image: why, in a few words."""


async def fetch_image_urls(body: Any, settings: ServerSettings) -> Any:
    """``body`` with each ``http(s)`` image URL replaced by the image it names, fetched; a URL that gives no image
    (an error status, a timeout, over the size limit) is a 400 naming its message and part. Without
    ``--allow-image-urls``, or for a text-only model, the body is left as it is: the doors refuse URLs there."""
    if settings.image_url_timeout is None or settings.vision is None or not isinstance(body, dict):
        return body
    urls: list[_Url] = []
    for name in _MESSAGE_FIELDS:
        _collect(body.get(name), name, urls)
    if not urls:
        return body
    limit = settings.image_limits.max_images
    if len(urls) > limit:  # refused before fetching any: a body cannot make the server fetch more than it takes
        where = urls[limit].where
        raise ApiError(400, f"'{where}': a request may hold at most {limit} images", param=where,
                       code="invalid_image")
    timeout = settings.image_url_timeout
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, max_redirects=_MAX_REDIRECTS,
                                 trust_env=False) as client:  # no proxy or .netrc credentials for a client's URL
        fetched = await asyncio.gather(*(_fetch_in_time(client, url, settings.image_limits.max_bytes, timeout)
                                         for url in urls))
    for url, (data, media_type) in zip(urls, fetched, strict=True):
        url.put(data, media_type)
    return body


def _collect(node: Any, where: str, urls: list[_Url]) -> None:
    """Every image URL under ``node`` (``where``: its name in the body), in the body's order."""
    if isinstance(node, list):
        for k, item in enumerate(node):
            _collect(item, f"{where}[{k}]", urls)
        return
    if not isinstance(node, dict):
        return
    url = _image_url(node, where)
    if url is not None:
        urls.append(url)
        return
    for key, value in node.items():
        if isinstance(value, list | dict):
            _collect(value, f"{where}.{key}", urls)


def _image_url(part: dict[str, Any], where: str) -> _Url | None:
    """The part's ``http(s)`` image URL, if it is an image part that names one (each door's own shape)."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI Chat: {"image_url": {"url": ...}}, or the URL as a string
        holder = part.get("image_url")
        if isinstance(holder, dict) and _is_http(holder.get("url")):
            return _Url(holder["url"], where, lambda data, media: holder.update(url=_data_uri(data, media)))
        if _is_http(holder):
            return _Url(holder, where, lambda data, media: part.update(image_url=_data_uri(data, media)))
    elif kind == "input_image" and _is_http(part.get("image_url")):  # Responses
        return _Url(part["image_url"], f"{where}.image_url",
                    lambda data, media: part.update(image_url=_data_uri(data, media)))
    elif kind == "image":  # Anthropic: {"source": {"type": "url", "url": ...}}
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "url" and _is_http(source.get("url")):
            return _Url(source["url"], f"{where}.source.url", lambda data, media: part.update(source={
                "type": "base64", "media_type": media, "data": base64.b64encode(data).decode()}))
    return None


def _is_http(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def _data_uri(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


async def _fetch_in_time(client: httpx.AsyncClient, url: _Url, max_bytes: int, timeout: float) -> tuple[bytes, str]:
    """The image at ``url`` and its media type, whole within ``timeout`` seconds; else a 400 naming its part."""
    try:
        # httpx's timeout bounds each read; this bounds the whole fetch (a server trickling bytes).
        return await asyncio.wait_for(_fetch(client, url.url, max_bytes), timeout)
    except _FetchFailed as e:
        reason = str(e)
    except TimeoutError:
        reason = f"no whole answer within {timeout:g} s (--image-url-timeout)"
    except httpx.TimeoutException:
        reason = f"no answer within {timeout:g} s (--image-url-timeout)"
    except httpx.HTTPError as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    raise ApiError(400, f"'{url.where}': the image at {url.url} could not be fetched: {reason}", param=url.where,
                   code="invalid_image")


async def _fetch(client: httpx.AsyncClient, url: str, max_bytes: int) -> tuple[bytes, str]:
    """The body of a GET of ``url``, refused past ``max_bytes`` without reading further."""
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise _FetchFailed(f"the server answered {response.status_code}")
        media_type = response.headers.get("content-type", "").split(";")[0].strip()
        if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
            raise _FetchFailed(f"it is {media_type}, not an image")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise _FetchFailed(f"it is {length} bytes, over the limit of {max_bytes} (--max-image-mb)")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > max_bytes:
                raise _FetchFailed(f"it is over the limit of {max_bytes} bytes (--max-image-mb)")
    return bytes(data), media_type or "application/octet-stream"
