"""Hostfiles: mlx.launch's JSON (list or object form), the same in YAML, and every error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlxpipe.cluster.hostfile import Hostfile, load_hostfile
from mlxpipe.errors import HostfileError
from mlxpipe.host import Host

REPO = Path(__file__).resolve().parents[2]
STUDIO = "/Users/me/mlxpipe/.venv/bin/python"

OBJECT_FORM: dict[str, Any] = {
    "backend": "ring",
    "envs": ["MLX_METAL_FAST_SYNCH=1"],
    "hosts": [
        {
            "ssh": "me@studio-1.local", "ips": ["192.168.200.1"], "memory_gb": 192,
            "wired_limit_gb": 180.5, "hf_home": "/Users/me/.cache/huggingface", "python": STUDIO,
        },
        {"ssh": "studio-2.local", "ips": ["192.168.200.2", "fe80::1"], "memory_gb": 64, "model_dir": "/Volumes/m"},
    ],
}


def write(tmp_path: Path, name: str, data: Any) -> Path:
    """Write ``data`` as JSON or YAML according to ``name``'s suffix (a str is written verbatim)."""
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data)
    elif path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text(json.dumps(data))
    return path


def host(ssh: str = "h1", **keys: Any) -> dict[str, Any]:
    return {"ssh": ssh, "ips": ["10.0.0.1"], **keys}


# --- Valid hostfiles -------------------------------------------------------------------


def test_list_form(tmp_path: Path) -> None:
    path = write(tmp_path, "h.json", [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, host("b")])
    assert load_hostfile(path) == Hostfile(
        path=path,
        hosts=(Host(rank=0, ssh="127.0.0.1", ips=("127.0.0.1",)), Host(rank=1, ssh="b", ips=("10.0.0.1",))),
        backend="",
        envs=(),
    )


def test_object_form_with_every_mlxpipe_key(tmp_path: Path) -> None:
    path = write(tmp_path, "h.json", OBJECT_FORM)
    assert load_hostfile(path) == Hostfile(
        path=path,
        hosts=(
            Host(
                rank=0, ssh="me@studio-1.local", ips=("192.168.200.1",), memory_gb=192.0,
                wired_limit_gb=180.5, hf_home="/Users/me/.cache/huggingface", python=STUDIO,
            ),
            Host(
                rank=1, ssh="studio-2.local", ips=("192.168.200.2", "fe80::1"), memory_gb=64.0, model_dir="/Volumes/m"
            ),
        ),
        backend="ring",
        envs=("MLX_METAL_FAST_SYNCH=1",),
    )


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
@pytest.mark.parametrize("data", [OBJECT_FORM, OBJECT_FORM["hosts"]], ids=["object", "list"])
def test_yaml_equals_json(tmp_path: Path, suffix: str, data: Any) -> None:
    from_json = load_hostfile(write(tmp_path, "h.json", data))
    from_yaml = load_hostfile(write(tmp_path, "h" + suffix, data))
    assert (from_yaml.hosts, from_yaml.backend, from_yaml.envs) == (from_json.hosts, from_json.backend, from_json.envs)


def test_yaml_written_by_hand(tmp_path: Path) -> None:
    text = "backend: jaccl\nhosts:\n  - ssh: studio-1\n    rdma: [null, rdma_en3]\n    memory_gb: 512\n"
    hf = load_hostfile(write(tmp_path, "h.yml", text))
    assert hf.hosts == (Host(rank=0, ssh="studio-1", rdma=(None, "rdma_en3"), memory_gb=512.0),)
    assert hf.backend == "jaccl"


SHIPPED = {
    "local-2.json": ("", ["127.0.0.1"] * 2, [None] * 2, [None] * 2),
    "local-3.json": ("", ["127.0.0.1"] * 3, [None] * 3, [None] * 3),
    "mac-studio-2-thunderbolt.json": ("ring", ["studio-1.local", "studio-2.local"], [192.0, 192.0], [None, None]),
    "mac-studio-4-thunderbolt.yaml": (
        "ring",
        ["studio-1.local", "studio-2.local", "studio-3.local", "studio-4.local"],
        [512.0, 512.0, 256.0, 256.0],
        [480.0, 480.0, None, None],
    ),
}


def test_every_shipped_example_is_checked() -> None:
    assert sorted(p.name for p in (REPO / "hostfiles").iterdir()) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_examples_parse(name: str) -> None:
    backend, ssh, memory, wired = SHIPPED[name]
    hf = load_hostfile(REPO / "hostfiles" / name)
    assert hf.backend == backend
    assert [h.ssh for h in hf.hosts] == ssh
    assert [h.memory_gb for h in hf.hosts] == memory
    assert [h.wired_limit_gb for h in hf.hosts] == wired
    assert [h.rank for h in hf.hosts] == list(range(len(ssh)))
    assert all(h.ips for h in hf.hosts)


def test_rank_is_file_order(tmp_path: Path) -> None:
    names = ["c", "a", "b", "a"]
    hf = load_hostfile(write(tmp_path, "h.json", [host(n) for n in names]))
    assert [(h.rank, h.ssh, h.label) for h in hf.hosts] == [
        (0, "c", "rank 0 (c)"), (1, "a", "rank 1 (a)"), (2, "b", "rank 2 (b)"), (3, "a", "rank 3 (a)"),
    ]
    assert hf.size == 4


def test_to_mlx_launch_drops_mlxpipe_keys(tmp_path: Path) -> None:
    data = {
        "backend": "jaccl",
        "envs": ["A=1"],
        "hosts": [
            {"ssh": "s1", "ips": [], "rdma": [None, "rdma_en3"], "memory_gb": 512, "wired_limit_gb": 480,
             "hf_home": "/h", "model_dir": "/m", "python": "/p"},
            {"ssh": "s2", "rdma": ["rdma_en3", None]},
        ],
    }
    assert load_hostfile(write(tmp_path, "h.json", data)).to_mlx_launch() == {
        "backend": "jaccl",
        "envs": ["A=1"],
        "hosts": [
            {"ssh": "s1", "ips": [], "rdma": [None, "rdma_en3"]},
            {"ssh": "s2", "ips": [], "rdma": ["rdma_en3", None]},
        ],
    }


def test_to_mlx_launch_of_a_list_form(tmp_path: Path) -> None:
    hf = load_hostfile(REPO / "hostfiles" / "local-2.json")
    local = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    assert hf.to_mlx_launch() == {"backend": "", "envs": [], "hosts": [local, local]}


@pytest.mark.parametrize(
    ("hosts", "declared"),
    [([host(memory_gb=8), host(memory_gb=16)], True), ([host(memory_gb=8), host()], False), ([host()], False)],
)
def test_memory_declared(tmp_path: Path, hosts: list[dict[str, Any]], declared: bool) -> None:
    assert load_hostfile(write(tmp_path, "h.json", hosts)).memory_declared() is declared


@pytest.mark.parametrize(
    "ssh", ["127.0.0.1", "studio-1.local", "me@studio-1", "first.last+x@10.0.0.2", "fe80::1%en0", "[::1]", "mac_mini"]
)
def test_accepted_ssh_destinations(tmp_path: Path, ssh: str) -> None:
    assert load_hostfile(write(tmp_path, "h.json", [host(ssh)])).hosts[0].ssh == ssh


# --- Errors: one line naming the file (and the host) ------------------------------------

HOST_ERRORS = [
    # (id, hosts, message after "<path>: ")
    ("no-ssh", [host("a"), {"ips": ["10.0.0.2"]}], "host 1: missing 'ssh'"),
    ("empty-ssh", [{"ssh": "", "ips": ["10.0.0.2"]}], "host 0: missing 'ssh'"),
    ("ssh-number", [{"ssh": 5, "ips": ["10.0.0.2"]}], "host 0: 'ssh' must be a host name string, got 5"),
    ("host-not-object", [host("a"), "b"], "host 1: expected an object with 'ssh', got str"),
    ("ssh-command", [host("h1; touch /tmp/x")], "host 0: 'ssh' value 'h1; touch /tmp/x' is not a host name"),
    ("ssh-option", [host("-oProxyCommand=touch /tmp/x")],
     "host 0: 'ssh' value '-oProxyCommand=touch /tmp/x' is not a host name"),
    ("ssh-option-plain", [host("-Jevil")], "host 0: 'ssh' value '-Jevil' is not a host name"),
    ("ssh-user-option", [host("-l@h")], "host 0: 'ssh' value '-l@h' is not a host name"),
    ("ssh-subshell", [host("$(id)")], "host 0: 'ssh' value '$(id)' is not a host name"),
    ("ssh-backticks", [host("`id`")], "host 0: 'ssh' value '`id`' is not a host name"),
    ("ssh-newline", [host("h1\n")], "host 0: 'ssh' value 'h1\\n' is not a host name"),
    ("ssh-space", [host("h1 h2")], "host 0: 'ssh' value 'h1 h2' is not a host name"),
    ("no-ips", [host("a"), {"ssh": "b"}], "host 1 (b) has no 'ips', which the ring backend needs"),
    ("empty-ips", [{"ssh": "b", "ips": []}], "host 0 (b) has no 'ips', which the ring backend needs"),
    ("ips-string", [{"ssh": "b", "ips": "10.0.0.1"}], "host 0 (b): 'ips' must be a list of addresses"),
    ("ips-number", [{"ssh": "b", "ips": [10]}], "host 0 (b): 'ips' must be a list of addresses"),
    ("ips-name", [{"ssh": "b", "ips": ["studio"]}], "host 0 (b): 'ips' entry 'studio' is not an IP address"),
    ("rdma-string", [host("b", rdma="rdma_en3")], "host 0 (b): 'rdma' must be a list"),
    ("memory-negative", [host("b", memory_gb=-8)], "host 0 (b): 'memory_gb' must be positive, got -8"),
    ("memory-zero", [host("b", memory_gb=0)], "host 0 (b): 'memory_gb' must be positive, got 0"),
    ("memory-string", [host("b", memory_gb="64")], "host 0 (b): 'memory_gb' must be a number, got '64'"),
    ("memory-unit", [host("b", memory_gb="64GB")], "host 0 (b): 'memory_gb' must be a number, got '64GB'"),
    ("memory-bool", [host("b", memory_gb=True)], "host 0 (b): 'memory_gb' must be a number, got True"),
    ("memory-nan", [host("b", memory_gb=float("nan"))], "host 0 (b): 'memory_gb' must be positive, got nan"),
    ("memory-inf", [host("b", memory_gb=float("inf"))], "host 0 (b): 'memory_gb' must be positive, got inf"),
    ("wired-negative", [host("b", wired_limit_gb=-1.5)], "host 0 (b): 'wired_limit_gb' must be positive, got -1.5"),
    ("hf-home-number", [host("b", hf_home=1)], "host 0 (b): 'hf_home' must be a non-empty path string"),
    ("model-dir-empty", [host("b", model_dir="")], "host 0 (b): 'model_dir' must be a non-empty path string"),
    ("python-newline", [host("b", python="/bin/py\nrm")], "host 0 (b): 'python' must be a non-empty path string"),
    ("unknown-key", [host("b", memory=64)], "host 0 (b): unknown key 'memory'"),
]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize(("hosts", "message"), [c[1:] for c in HOST_ERRORS], ids=[c[0] for c in HOST_ERRORS])
def test_host_errors(tmp_path: Path, suffix: str, hosts: list[Any], message: str) -> None:
    path = write(tmp_path, "cluster" + suffix, {"hosts": hosts})
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: {message}"


FILE_ERRORS = [
    ("scalar", 5, "expected a list of hosts or an object with 'hosts'", "see hostfiles/local-2.json for the format"),
    ("no-hosts", {"backend": "ring"}, "no 'hosts' list", "add 'hosts': [{\"ssh\": ...}, ...]"),
    ("empty-hosts", {"hosts": []}, "'hosts' must be a non-empty list", None),
    ("empty-list", [], "'hosts' must be a non-empty list", None),
    ("hosts-object", {"hosts": {"ssh": "a"}}, "'hosts' must be a non-empty list", None),
    ("unknown-top-key", {"hosts": [host()], "backends": "ring"}, "unknown top-level key 'backends'",
     "the top level may hold 'backend', 'envs' and 'hosts'"),
    ("unknown-backend", {"backend": "tcp", "hosts": [host()]}, "unknown backend 'tcp'",
     "use one of: ring, jaccl, jaccl-ring, mpi, nccl"),
    ("backend-number", {"backend": 1, "hosts": [host()]}, "unknown backend 1",
     "use one of: ring, jaccl, jaccl-ring, mpi, nccl"),
    ("envs-string", {"envs": "A=1", "hosts": [host()]}, "'envs' must be a list of 'NAME=value' strings", None),
    ("envs-no-value", {"envs": ["A"], "hosts": [host()]}, "'envs' must be a list of 'NAME=value' strings", None),
]


@pytest.mark.parametrize("suffix", [".json", ".yml"])
@pytest.mark.parametrize(("data", "message", "hint"), [c[1:] for c in FILE_ERRORS], ids=[c[0] for c in FILE_ERRORS])
def test_file_errors(tmp_path: Path, suffix: str, data: Any, message: str, hint: str | None) -> None:
    path = write(tmp_path, "cluster" + suffix, data)
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert (str(e.value), e.value.hint) == (f"{path}: {message}", hint)


@pytest.mark.parametrize("backend", ["", None, "ring"])
def test_ring_or_default_backend_needs_ips(tmp_path: Path, backend: str | None) -> None:
    path = write(tmp_path, "h.json", {"backend": backend, "hosts": [{"ssh": "studio-1"}]})
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: host 0 (studio-1) has no 'ips', which the ring backend needs"
    assert e.value.hint == 'add "ips": ["<address the other hosts reach it on>"]'


@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring", "mpi", "nccl"])
def test_other_backends_need_no_ips(tmp_path: Path, backend: str) -> None:
    hf = load_hostfile(write(tmp_path, "h.json", {"backend": backend, "hosts": [{"ssh": "studio-1"}]}))
    assert (hf.backend, hf.hosts) == (backend, (Host(rank=0, ssh="studio-1"),))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert (str(e.value), e.value.hint) == (f"{path}: no such hostfile", "pass --hostfile with an existing file")


def test_unreadable_file(tmp_path: Path) -> None:
    # A directory: unreadable as a file even for root (who ignores chmod 000).
    with pytest.raises(HostfileError) as e:
        load_hostfile(tmp_path)
    assert str(e.value) == f"{tmp_path}: cannot read hostfile (Is a directory)"


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert (str(e.value), e.value.hint) == (f"{path}: not a text file", "a hostfile is JSON or YAML text")


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("h.json", "", "JSON (Expecting value: line 1 column 1 (char 0))"),
        ("h.json", '{"hosts": [}', "JSON (Expecting value: line 1 column 12 (char 11))"),
        ("h.json", "hosts:\n  - ssh: a\n", "JSON (Expecting value: line 1 column 1 (char 0))"),
        ("h.yaml", "hosts: [\n", "YAML (while parsing a flow node)"),
        ("h.yml", "hosts:\n  - ssh: a\n ips: [1]\n", "YAML (while parsing a block mapping)"),
    ],
    ids=["json-empty", "json-unclosed", "yaml-in-json", "yaml-unclosed", "yaml-indent"],
)
def test_invalid_syntax(tmp_path: Path, name: str, text: str, reason: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: not valid {reason}"


def test_empty_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "h.yaml", "# nothing yet\n")
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: expected a list of hosts or an object with 'hosts'"


def test_first_bad_host_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "h.json", [host("a"), host("b", memory_gb=-1), host("c", memory_gb=-2)])
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: host 1 (b): 'memory_gb' must be positive, got -1"


def test_yaml_infinity_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "h.yaml", "- ssh: a\n  ips: [10.0.0.1]\n  memory_gb: .inf\n")
    with pytest.raises(HostfileError) as e:
        load_hostfile(path)
    assert str(e.value) == f"{path}: host 0 (a): 'memory_gb' must be positive, got inf"
