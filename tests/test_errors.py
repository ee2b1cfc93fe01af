"""errors.py: every error a user can cause carries a one-line message and a hint."""

from __future__ import annotations

import pytest

from mlxpipe import errors
from mlxpipe.errors import HubError, HubUnreachable, MlxpipeError


def test_the_message_is_the_string_and_the_hint_is_apart() -> None:
    error = HubUnreachable("org/m: cannot reach the hub", "check the network")
    assert (str(error), error.message, error.hint) == ("org/m: cannot reach the hub", "org/m: cannot reach the hub",
                                                       "check the network")
    assert isinstance(error, HubError)  # a cached answer may stand in for an unreachable hub's
    assert MlxpipeError("no hint").hint is None


@pytest.mark.parametrize("name", ["UsageError", "HostfileError", "ConfigError", "ModelError", "HubError",
                                  "HubUnreachable", "PlanError", "DownloadError", "LaunchError", "RequestFailed",
                                  "FleetError"])
def test_every_error_mlxpipe_raises_on_purpose_is_an_mlxpipe_error(name: str) -> None:
    # The CLI's boundary prints an MlxpipeError as one line; anything else keeps its traceback.
    assert issubclass(getattr(errors, name), MlxpipeError)
