"""cluster/remote.py: the ssh, rsync and scp command lines that send files to a host.

The multi-host test (``tests/e2e/test_ssh_cluster.py``) runs them for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.hostfiles import load_hostfile_host
from mlxpipe.cluster import remote
from mlxpipe.errors import DownloadError

# --- Sending over ssh: the commands (the multi-host test runs them for real) -------------------


def shipment() -> remote.Shipment:
    return remote.Shipment(
        "/ctl/hf/hub", "~/.cache/huggingface/hub",
        ("models--o--m/blobs/abc", "models--o--m/refs/main"),
        (("models--o--m/snapshots/c1/model.safetensors", "../../blobs/abc"),),
    )


def test_rsync_sends_exactly_the_paths_in_batch_mode() -> None:
    host = load_hostfile_host("me@studio-2")
    assert remote.rsync_argv(host, shipment()) == [
        "rsync", "-a", "--relative", "--copy-unsafe-links",
        "-e", "ssh -o BatchMode=yes -o ConnectTimeout=10 -o LogLevel=ERROR -l me --", "--",
        "/ctl/hf/hub/./models--o--m/blobs/abc", "/ctl/hf/hub/./models--o--m/refs/main",
        "/ctl/hf/hub/./models--o--m/snapshots/c1/model.safetensors",
        "studio-2:.cache/huggingface/hub/",
    ]


def test_scp_fallback_commands_are_quoted_and_atomic() -> None:
    host = load_hostfile_host("studio-2")
    s = shipment()
    assert remote.ssh_argv(host, remote._mkdir_command(s))[:8] == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "--",
    ]
    assert remote._mkdir_command(s) == (
        "mkdir -p -- .cache/huggingface/hub .cache/huggingface/hub/models--o--m/blobs "
        ".cache/huggingface/hub/models--o--m/refs .cache/huggingface/hub/models--o--m/snapshots/c1"
    )
    assert remote.scp_argv(host, s, "models--o--m/blobs/abc")[-3:] == [
        "--", "/ctl/hf/hub/models--o--m/blobs/abc",
        "studio-2:.cache/huggingface/hub/models--o--m/blobs/abc.mlxpipe-partial",
    ]
    assert remote._finish_command(s).split(" && ") == [
        "mv -f -- .cache/huggingface/hub/models--o--m/blobs/abc.mlxpipe-partial "
        ".cache/huggingface/hub/models--o--m/blobs/abc",
        "mv -f -- .cache/huggingface/hub/models--o--m/refs/main.mlxpipe-partial "
        ".cache/huggingface/hub/models--o--m/refs/main",
        "ln -sfn -- ../../blobs/abc .cache/huggingface/hub/models--o--m/snapshots/c1/model.safetensors",
    ]


def test_a_remote_path_a_shell_would_split_is_refused(tmp_path: Path) -> None:
    host = load_hostfile_host("studio-2")
    bad = remote.Shipment("/ctl", "/Volumes/My Disk/hf/hub; rm -rf ~", ("a.json",))
    with pytest.raises(DownloadError, match="cannot send to '/Volumes/My Disk/hf/hub; rm -rf ~' over ssh safely"):
        remote.send(host, bad, "studio-2 (rank 1)")
