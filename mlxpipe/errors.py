"""The errors mlxpipe raises on purpose.

Every error a user can cause (a bad hostfile, a split that does not sum, a
repo that does not exist, a rank that died) is an ``MlxpipeError``. The CLI
turns them into one line plus a hint and exit status 1; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class MlxpipeError(Exception):
    """Base class: ``message`` says what is wrong, ``hint`` what to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(MlxpipeError):
    """Flags that contradict each other or are out of range (exit 2)."""


class WireError(UsageError):
    """A message or event that is not what this side's contract says (a field it does not know or lacks, an
    unknown kind): refused, never guessed at. Between two mlxpipe versions, or a bug."""


class HostfileError(MlxpipeError):
    """The hostfile cannot be read or describes an impossible cluster."""


class ConfigError(MlxpipeError):
    """A ``configs/*.yaml`` preset is malformed."""


class ModelError(MlxpipeError):
    """The model's metadata is missing, unreadable or unsupported."""


class HubError(MlxpipeError):
    """The hub refused or could not serve a request (missing, gated, offline)."""


class HubUnreachable(HubError):
    """The hub could not be reached or failed on its side (refused, DNS, TLS, timeout, 5xx, offline).

    Worth telling apart from the other ``HubError``s: a cached answer may stand in for it.
    """


class PlanError(MlxpipeError):
    """No valid layer split exists for this model and cluster."""


class DownloadError(MlxpipeError):
    """A weight file could not be fetched, verified or stored."""


class LaunchError(MlxpipeError):
    """The distributed run could not start or a rank failed."""


class SetupError(MlxpipeError):
    """A machine could not be found, surveyed or set up (``mlxpipe cluster``): which host, and what to do."""


class RequestFailed(MlxpipeError):
    """One request failed on a rank (its options, its sampler): that request ends, the pipeline goes on."""


class FleetError(MlxpipeError):
    """A fleet file (``serve --fleet``) is malformed or describes a fleet that cannot be: which file, entry and key."""
