"""cli/_errors.py, the one error boundary: an unmapped network error is one line; a bug keeps its traceback."""

from __future__ import annotations

import os
from typing import Any

import pytest

from fixtures.fake_hub import closed_port_endpoint
from fixtures.hub_errors import NET_HINT, assert_one_error, invoke_command
from mlxpipe.cluster import target as target_mod


def test_the_boundary_maps_a_network_error_nobody_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A future command calling the hub outside hub_errors still gets one line, not a traceback."""
    from huggingface_hub import HfApi

    ep = closed_port_endpoint()

    def unmapped(*args: Any, **kwargs: Any) -> Any:
        return HfApi(endpoint=ep).model_info("org/model", timeout=2)  # raises httpx's ConnectError

    monkeypatch.setattr(target_mod, "load_model_metadata", unmapped)
    result = invoke_command("plan", "--model", "org/model")
    assert_one_error(result, f"error: cannot reach the hub at {ep}: connection refused",
                     NET_HINT.format(ep=os.environ.get("HF_ENDPOINT") or "https://huggingface.co"))


def test_the_boundary_lets_a_bug_keep_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a bug")

    monkeypatch.setattr(target_mod, "load_model_metadata", bug)
    result = invoke_command("plan", "--model", "org/model")
    assert isinstance(result.exception, ValueError)
