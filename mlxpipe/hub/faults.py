"""Hub faults: huggingface_hub's and the network's exceptions as one-line ``HubError``s.

Network faults (refused connection, DNS, TLS, timeout, 5xx, 429, ``HF_HUB_OFFLINE``)
become one ``HubUnreachable`` naming the host that failed and what to do. Used on the
controller and on every host (``download.fetch``), so it imports nothing of mlxpipe's
but its errors and the cache settings.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from mlxpipe.errors import HubError, HubUnreachable, MlxpipeError
from mlxpipe.hub.cache import offline


@contextmanager
def hub_errors(repo: str, host: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's and the network's exceptions into one-line ``HubError``s naming the repo."""
    try:
        yield
    except Exception as e:  # mapped below, or re-raised as it is
        mapped = as_hub_error(e, repo, host)
        if mapped is None:
            raise
        raise mapped from None


def as_hub_error(e: BaseException, repo: str | None = None, host: str | None = None) -> HubError | None:
    """The ``HubError`` for ``e`` (about ``repo``, as seen from ``host``), or None if ``e`` is not the hub's."""
    from huggingface_hub import errors as hf

    if isinstance(e, MlxpipeError):
        return None
    name = f"{repo}: " if repo else ""
    where = f" (on {host})" if host else ""
    login = "log in with `hf auth login` or set HF_TOKEN" + (f" on {host}" if host else "")
    fault = network_fault(e, host)
    if fault is not None:
        if fault.offline and repo:
            return HubUnreachable(
                f"{repo}: offline (HF_HUB_OFFLINE=1) and a file it needs is not in the Hugging Face cache{where}",
                f"run `mlxpipe download --model {repo}` once online, or unset HF_HUB_OFFLINE",
            )
        prefix = f"{repo}{where}: " if repo else (f"{host}: " if host else "")
        return HubUnreachable(prefix + fault.problem, fault.hint)
    if isinstance(e, hf.GatedRepoError):
        return HubError(
            f"{repo} is gated{where}: you must accept its terms and be logged in",
            f"accept the terms on the model's page, then {login}",
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return HubError(
            f"{name}no such model repo on {_endpoint()}{where}, or it is private",
            f"check the name; if it is private, {login}",
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{name}no such revision{where}", "check --revision")
    if isinstance(e, hf.LocalEntryNotFoundError):
        return HubError(
            f"{name}not in the local cache and the hub at {_endpoint()} cannot be reached{where}",
            "check the network (or HF_ENDPOINT), or download the model first",
        )
    if isinstance(e, hf.EntryNotFoundError):
        return HubError(f"{name}file missing from the repo{where} ({_short(e)})")
    if isinstance(e, hf.HfHubHTTPError):
        status = _status(e)
        if status in (401, 403):
            return HubError(f"{name}access refused ({status}){where}", login)
        return HubError(f"{name}the hub answered an error{where}: {_short(e)}")
    return None


# --- Network faults: what failed, on which host, and what to do -----------------------

_DNS_WORDS = ("name or service not known", "nodename nor servname", "name resolution", "no address associated",
              "getaddrinfo failed")


@dataclass(frozen=True)
class NetworkFault:
    """The hub could not be reached or failed: ``problem`` names the host, ``hint`` says what to do."""

    problem: str
    hint: str
    offline: bool = False
    transient: bool = True  # worth another attempt (a refusal or a 503 may pass; offline mode will not)


def network_fault(e: BaseException, host: str | None = None) -> NetworkFault | None:
    """Why ``e`` means the hub is unreachable or failing, or None when it is something else.

    Looks through the whole ``__cause__`` chain: huggingface_hub wraps a failed
    HEAD in ``LocalEntryNotFoundError``, httpx wraps the socket's own error.
    """
    import httpx2
    from huggingface_hub import errors as hf

    chain = _chain(e)
    if any(isinstance(x, hf.OfflineModeIsEnabled) for x in chain) or (
        isinstance(e, hf.LocalEntryNotFoundError) and offline()
    ):
        return NetworkFault(
            "offline (HF_HUB_OFFLINE=1) and what is needed is not in the local cache",
            "run the same command once online, or unset HF_HUB_OFFLINE", offline=True, transient=False,
        )
    on = f" of {host}" if host else ""
    net = f"check the network{on} and HF_ENDPOINT ({_endpoint()})"
    cached = "a model already downloaded works offline with HF_HUB_OFFLINE=1"
    for x in chain:
        if isinstance(x, hf.HfHubHTTPError) and (_status(x) or 0) >= 500:
            return NetworkFault(
                f"the hub at {_origin(x)} answered {_status(x)} {_reason(x)}",
                f"the hub is failing on its side: try again in a few minutes; {cached}",
            )
        if isinstance(x, hf.HfHubHTTPError) and _status(x) == 429:
            return NetworkFault(
                f"the hub at {_origin(x)} is rate-limiting this machine (429 Too Many Requests)",
                "wait a few minutes and run it again; logged-in users (HF_TOKEN) get a higher limit",
            )
        if isinstance(x, httpx2.TransportError):
            return _transport_fault(x, chain, on, net, cached)
    return None


def _transport_fault(x: BaseException, chain: list[BaseException], on: str, net: str, cached: str) -> NetworkFault:
    import httpx2

    origin = _origin(x)
    text = " ".join(str(c) for c in chain).lower()
    if any(isinstance(c, socket.gaierror) for c in chain) or any(w in text for w in _DNS_WORDS):
        hostname = urlsplit(origin).hostname or origin
        return NetworkFault(
            f"cannot reach the hub at {origin}: the name {hostname} does not resolve (DNS)",
            f"{net}; {cached}",
        )
    tls = next((c for c in chain if isinstance(c, ssl.SSLError)), None)
    if tls is not None or "[ssl" in text:
        return NetworkFault(
            f"cannot reach the hub at {origin}: the TLS handshake failed ({_short(tls or x)})",
            f"check the system clock{on}, the CA certificates (SSL_CERT_FILE) and any proxy on the way "
            f"(HTTPS_PROXY), and that HF_ENDPOINT ({_endpoint()}) speaks https",
            transient=False,
        )
    if isinstance(x, httpx2.TimeoutException):
        seconds = _timeout_of(x)
        within = f" within {seconds:g} s" if seconds else ""
        return NetworkFault(
            f"the hub at {origin} did not answer{within}",
            f"{net}; on a slow link raise HF_HUB_ETAG_TIMEOUT; {cached}",
        )
    if any(isinstance(c, ConnectionRefusedError) for c in chain) or "connection refused" in text:
        return NetworkFault(f"cannot reach the hub at {origin}: connection refused", f"{net}; {cached}")
    return NetworkFault(f"cannot reach the hub at {origin} ({_short(x)})", f"{net}; {cached}")


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = e
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _origin(e: BaseException) -> str:
    """``scheme://host:port`` of the request that failed (a redirect's target included), else the endpoint."""
    url = None
    try:
        url = e.request.url  # type: ignore[attr-defined]  # httpx errors; raises when unset
    except Exception:  # noqa: BLE001 - no request attached
        response = getattr(e, "response", None)
        url = getattr(response, "url", None)
    parts = urlsplit(str(url)) if url else None
    return f"{parts.scheme}://{parts.netloc}" if parts and parts.netloc else _endpoint()


def _timeout_of(e: BaseException) -> float | None:
    try:
        timeouts = e.request.extensions.get("timeout") or {}  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None
    return timeouts.get("read") or timeouts.get("connect")


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def _reason(e: BaseException) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(_status(e) or 0).phrase
    except ValueError:
        return "(server error)"


def _endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
