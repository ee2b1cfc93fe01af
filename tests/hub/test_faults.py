"""hub/faults.py: huggingface_hub's and the network's exceptions as one-line errors naming the host and the fix.

The exceptions are the real ones huggingface_hub and its HTTP client raise, built
here with the request they would carry (``hub/test_offline.py`` makes them happen
through the CLI against real closed ports and a fake hub).
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import httpx2
import pytest
from huggingface_hub import errors as hf

from mlxpipe.errors import HubError, HubUnreachable, UsageError
from mlxpipe.hub.faults import as_hub_error, hub_errors, network_fault

HUB = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", HUB)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def request(url: str = f"{HUB}/api/models/org/model", **extensions: Any) -> httpx2.Request:
    return httpx2.Request("GET", url, extensions=extensions)


def answered(status: int, error: type[hf.HfHubHTTPError] = hf.HfHubHTTPError) -> hf.HfHubHTTPError:
    return error(f"{status} from the hub", response=httpx2.Response(status, request=request()))


def caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def test_errors_that_are_not_the_hubs_are_left_alone() -> None:
    assert as_hub_error(ValueError("a bug"), "org/model") is None
    assert as_hub_error(UsageError("already mapped"), "org/model") is None
    assert network_fault(KeyError("x")) is None


def test_a_refused_connection_names_the_hub_and_what_to_check() -> None:
    error = caused(httpx2.ConnectError("connect failed", request=request()), ConnectionRefusedError(111, "refused"))
    fault = network_fault(error, "studio-2")
    assert fault is not None and fault.transient and not fault.offline
    assert fault.problem == f"cannot reach the hub at {HUB}: connection refused"
    assert fault.hint.startswith(f"check the network of studio-2 and HF_ENDPOINT ({HUB}); ")


def test_a_name_that_does_not_resolve_is_named_as_dns() -> None:
    url = "https://hub.invalid/api/models/org/model"
    error = caused(httpx2.ConnectError("connect failed", request=request(url)), socket.gaierror(-2, "Name or service"))
    mapped = as_hub_error(error, "org/model")
    assert isinstance(mapped, HubUnreachable)
    assert mapped.message == ("org/model: cannot reach the hub at https://hub.invalid: "
                              "the name hub.invalid does not resolve (DNS)")


def test_a_tls_failure_is_not_worth_another_attempt() -> None:
    error = caused(httpx2.ConnectError("handshake", request=request()), ssl.SSLError(1, "[SSL] wrong version number"))
    fault = network_fault(error)
    assert fault is not None and not fault.transient
    assert fault.problem.startswith(f"cannot reach the hub at {HUB}: the TLS handshake failed (")
    assert "SSL_CERT_FILE" in fault.hint and "HTTPS_PROXY" in fault.hint


def test_a_timeout_says_how_long_it_waited() -> None:
    fault = network_fault(httpx2.ReadTimeout("timed out", request=request(timeout={"read": 2.5})))
    assert fault is not None and fault.problem == f"the hub at {HUB} did not answer within 2.5 s"
    assert "HF_HUB_ETAG_TIMEOUT" in fault.hint


@pytest.mark.parametrize(("status", "problem"), [
    (503, f"the hub at {HUB} answered 503 Service Unavailable"),
    (500, f"the hub at {HUB} answered 500 Internal Server Error"),
    (429, f"the hub at {HUB} is rate-limiting this machine (429 Too Many Requests)"),
])
def test_a_failing_or_rate_limiting_hub_is_a_transient_fault(status: int, problem: str) -> None:
    fault = network_fault(answered(status))
    assert fault is not None and fault.transient and fault.problem == problem


def test_a_fault_deep_in_the_cause_chain_is_found() -> None:
    # huggingface_hub wraps a failed request in LocalEntryNotFoundError; the socket's error sits below it.
    inner = caused(httpx2.ConnectError("connect failed", request=request()), ConnectionRefusedError(111, "refused"))
    outer = caused(hf.LocalEntryNotFoundError("not cached"), inner)
    mapped = as_hub_error(outer, "org/model", "studio-2")
    assert isinstance(mapped, HubUnreachable)
    assert mapped.message == f"org/model (on studio-2): cannot reach the hub at {HUB}: connection refused"
    assert mapped.hint == (f"check the network of studio-2 and HF_ENDPOINT ({HUB}); "
                           "a model already downloaded works offline with HF_HUB_OFFLINE=1")


def test_offline_mode_names_the_repo_and_how_to_get_it_once_online() -> None:
    mapped = as_hub_error(hf.OfflineModeIsEnabled("offline"), "org/model", "studio-2")
    assert isinstance(mapped, HubUnreachable)
    assert mapped.message == ("org/model: offline (HF_HUB_OFFLINE=1) and a file it needs is not in the "
                              "Hugging Face cache (on studio-2)")
    assert mapped.hint == "run `mlxpipe download --model org/model` once online, or unset HF_HUB_OFFLINE"
    assert network_fault(hf.OfflineModeIsEnabled("offline")).transient is False  # type: ignore[union-attr]


@pytest.mark.parametrize(("error", "message", "hint"), [
    (answered(404, hf.RepositoryNotFoundError), f"org/model: no such model repo on {HUB}, or it is private",
     "check the name; if it is private, log in with `hf auth login` or set HF_TOKEN"),
    (answered(403, hf.GatedRepoError), "org/model is gated: you must accept its terms and be logged in",
     "accept the terms on the model's page, then log in with `hf auth login` or set HF_TOKEN"),
    (answered(404, hf.RevisionNotFoundError), "org/model: no such revision", "check --revision"),
    (answered(401), "org/model: access refused (401)", "log in with `hf auth login` or set HF_TOKEN"),
])
def test_the_hubs_answers_are_one_line_with_what_to_do(error: BaseException, message: str, hint: str) -> None:
    mapped = as_hub_error(error, "org/model")
    assert type(mapped) is HubError
    assert (mapped.message, mapped.hint) == (message, hint)


def test_a_host_that_must_log_in_is_named_in_the_hint() -> None:
    mapped = as_hub_error(answered(403), "org/model", "studio-2")
    assert mapped is not None and mapped.hint == "log in with `hf auth login` or set HF_TOKEN on studio-2"


def test_hub_errors_raises_the_mapped_error_and_lets_others_through() -> None:
    with pytest.raises(HubError) as info, hub_errors("org/model"):
        raise answered(404, hf.RepositoryNotFoundError)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one line, no chained traceback
    with pytest.raises(ZeroDivisionError), hub_errors("org/model"):
        1 / 0  # noqa: B018 - the error is the point
