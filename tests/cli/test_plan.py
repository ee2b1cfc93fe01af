"""``mlxpipe plan`` through Typer's runner and as the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures.cluster_facts import facts_beside
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.cli import app
from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.host import GB
from mlxpipe.hub.client import load_metadata
from mlxpipe.model.metadata import kv_bytes_per_token
from mlxpipe.plan.costs import RUNTIME_OVERHEAD, kv_bytes
from mlxpipe.plan.shard import make_plan

REPO = Path(__file__).resolve().parents[2]
LOCAL_2 = REPO / "hostfiles" / "local-2.json"
MLXPIPE = Path(sys.executable).parent / "mlxpipe"
CONTEXT = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 6-layer llama in 3 shards (2 layers per shard)."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("cli") / "llama")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def mlxpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MLXPIPE), *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def rows(table: str) -> list[tuple[str, str, str]]:
    """(rank, host, layers) of every rank row of a rendered plan table."""
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            out.append((cells[0], cells[1], cells[2]))
    return out


def expected_json(model: Path, hostfile: Path, **kwargs: Any) -> dict[str, Any]:
    plan = make_plan(load_metadata(str(model)), load_hostfile(hostfile).hosts, **kwargs)
    return json.loads(json.dumps(plan.to_json()))


def write_hostfile(path: Path, budgets: list[float]) -> Path:
    """Local ranks whose GPU may use exactly ``budgets`` bytes."""
    hosts = [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "memory_gb": 8, "wired_limit_gb": b / GB} for b in budgets
    ]
    path.write_text(json.dumps(hosts))
    return path


def layer_budget(model: Path, layers: float) -> float:
    """A budget that holds the shared tensors plus ``layers`` layers (and their KV) of ``model``."""
    meta = load_metadata(str(model))
    shared = sum(t.nbytes for t in meta.tensors if meta.layer_of(t) is None)
    per_layer = sum(t.nbytes for t in meta.tensors if meta.layer_of(t) == 0)
    per_kv = kv_bytes(kv_bytes_per_token(meta)[:1], CONTEXT)
    return RUNTIME_OVERHEAD + shared + layers * (per_layer + per_kv)


# --- The table and JSON ------------------------------------------------------------------


def test_table(model: Path) -> None:
    result = invoke("plan", "--model", str(model), "--hostfile", str(REPO / "hostfiles" / "local-3.json"))
    assert result.exit_code == 0, result.output
    title = result.stdout.split("┏")[0]  # Rich wraps a title wider than the table
    assert " ".join(title.split()) == f"{model} · 6 layers · strategy balanced"
    assert rows(result.stdout) == [
        ("0", "127.0.0.1", "4-5 (2)"), ("1", "127.0.0.1", "2-3 (2)"), ("2", "127.0.0.1", "0-1 (2)"),
    ]
    assert result.stderr == ""


def test_table_of_named_hosts_with_memory(model: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "cluster.yaml"
    hostfile.write_text(
        "hosts:\n"
        "  - {ssh: studio-1.local, ips: [10.0.0.1], memory_gb: 192}\n"
        "  - {ssh: me@mini.local, ips: [10.0.0.2], memory_gb: 64}\n"
    )
    result = invoke("plan", "--model", str(model), "--hostfile", str(hostfile))
    assert result.exit_code == 0, result.output
    # memory strategy: budgets 3:1 -> 1 + 3 and 1 + 1 layers
    assert rows(result.stdout) == [("0", "studio-1.local", "2-5 (4)"), ("1", "me@mini.local", "0-1 (2)")]
    assert " ".join(result.stdout.split("┏")[0].split()).endswith("· 6 layers · strategy memory")
    assert "note: Budgets assume macOS's default GPU wired limit" in result.stdout


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ([], {}),
        (["--strategy", "even"], {"strategy": "even"}),
        (["--split", "1,5"], {"split": (1, 5)}),
        (["--split", "5,1", "--context", "100"], {"split": (5, 1), "context": 100}),
    ],
)
def test_json_is_the_planner_s_plan(model: Path, args: list[str], kwargs: dict[str, Any]) -> None:
    result = invoke("plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--json", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == expected_json(model, LOCAL_2, **kwargs)
    assert result.stderr == ""


def test_json_content(model: Path) -> None:
    data = json.loads(invoke("plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--json").stdout)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    summary = (data["model"], data["strategy"], data["num_layers"], data["split"], data["fits"])
    assert summary == (str(model), "balanced", 6, [3, 3], True)
    # Rank 0's share of the work per token counts the vocabulary head besides its 3 layers.
    shares = [r["work_share"] for r in data["ranks"]]
    assert sum(shares) == pytest.approx(1) and shares[0] > shares[1]
    # Rank 0 runs the last layers; the embeddings (shard 1) and the head (shard 3) go everywhere.
    assert [(r["rank"], r["host"], r["start"], r["end"], r["layers"], r["files"]) for r in data["ranks"]] == [
        (0, "127.0.0.1", 3, 6, 3, shards), (1, "127.0.0.1", 0, 3, 3, shards),
    ]


# --- Not fitting: exit 1 and a split that fits ------------------------------------------


def test_rank_that_does_not_fit_gets_a_split_that_does(model: Path, tmp_path: Path) -> None:
    # Rank 0 holds at most 1 layer, rank 1 up to 5: the even 3,3 does not fit, 1,5 does.
    hostfile = write_hostfile(tmp_path / "small.json", [layer_budget(model, 1.5), layer_budget(model, 5.5)])
    base = ["plan", "--model", str(model), "--hostfile", str(hostfile), "--context", str(CONTEXT)]
    result = invoke(*base, "--strategy", "even")
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: rank 0 (127.0.0.1) cannot hold its share at --context {CONTEXT}\n"
        "hint: this split fits: --split 1,5\n"
    )
    assert [r[2] for r in rows(result.stdout)] == ["3-5 (3)", "0-2 (3)"]
    fixed = invoke(*base, "--split", "1,5")
    assert (fixed.exit_code, fixed.stderr) == (0, "")
    assert [r[2] for r in rows(fixed.stdout)] == ["5-5 (1)", "0-4 (5)"]


def test_rank_that_does_not_fit_json(model: Path, tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path / "small.json", [layer_budget(model, 1.5), layer_budget(model, 5.5)])
    result = invoke("plan", "--model", str(model), "--hostfile", str(hostfile), "--context", str(CONTEXT),
                    "--strategy", "even", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert (data["fits"], data["suggested_split"], [r["fits"] for r in data["ranks"]]) == (False, [1, 5], [False, True])
    assert result.stderr.endswith("hint: this split fits: --split 1,5\n")


def test_no_split_fits(model: Path, tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path / "tiny.json", [layer_budget(model, 0.5), layer_budget(model, 0.5)])
    result = invoke("plan", "--model", str(model), "--hostfile", str(hostfile), "--context", str(CONTEXT))
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: rank 0 (127.0.0.1), rank 1 (127.0.0.1) cannot hold its share at --context {CONTEXT}\n"
        "hint: no split fits these hosts: add hosts or memory, or use a smaller (more quantized) model\n"
    )


# --- Usage and input errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        (["--split", "1,x"], "error: --split '1,x': expected comma-separated layer counts such as 10,12,8\n"),
        (["--split", "2,2"], "error: --split 2,2 sums to 4 but the model has 6 layers\n"
                             "hint: the layer counts must add up to the model's layers\n"),
        (["--split", "6"], "error: --split has 1 entries but the hostfile has 2 hosts\n"
                           "hint: give one layer count per host, in rank order\n"),
        (["--split", "0,6"], "error: --split 0,6: every rank needs at least one layer\n"),
        (["--split", "3,3", "--strategy", "even"], "error: --split and --strategy conflict\nhint: give one of them\n"),
        (["--strategy", "fast"],
         "error: unknown strategy 'fast'\nhint: use one of: even, memory, balanced or --split\n"),
        (["--context", "0"], "error: --context must be positive, got 0\n"),
    ],
    ids=["not-numbers", "wrong-sum", "wrong-length", "zero", "with-strategy", "unknown-strategy", "context"],
)
def test_usage_errors_exit_2(model: Path, args: list[str], stderr: str) -> None:
    result = invoke("plan", "--model", str(model), "--hostfile", str(LOCAL_2), *args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", stderr)


def test_missing_hostfile_names_the_file(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("plan", "--model", str(model), "--hostfile", "cluster/nope.json")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == "error: cluster/nope.json: no such hostfile\nhint: pass --hostfile with an existing file\n"


def test_bad_hostfile_names_file_and_host(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    hosts = [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"], "memory_gb": -4}]
    Path("h.json").write_text(json.dumps(hosts))
    result = invoke("plan", "--model", str(model), "--hostfile", "h.json")
    assert (result.exit_code, result.stderr) == (1, "error: h.json: host 1 (b): 'memory_gb' must be positive, got -4\n")


def test_more_ranks_than_layers(model: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "h.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 7))
    result = invoke("plan", "--model", str(model), "--hostfile", str(hostfile))
    assert (result.exit_code, result.stderr) == (
        1, "error: the hostfile has 7 hosts but the model has only 6 layers\nhint: use at most one host per layer\n",
    )


def test_unknown_model_type(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for f in model.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    config = {**json.loads((model / "config.json").read_text()), "model_type": "nope"}
    (other / "config.json").write_text(json.dumps(config))
    result = invoke("plan", "--model", str(other), "--hostfile", str(LOCAL_2))
    assert (result.exit_code, result.stderr) == (
        1,
        f"error: {other}: model_type 'nope' is not supported by the installed mlx-lm\n"
        "hint: upgrade mlx-lm (pip install -U mlx-lm) or pick a supported model\n",
    )


# --- --config presets: flag, then preset, then default ---------------------------------


def preset(tmp_path: Path, text: str) -> str:
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    return str(path)


def plan_json(*args: str) -> dict[str, Any]:
    result = invoke("plan", "--hostfile", str(LOCAL_2), "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_preset_supplies_model_and_split(model: Path, tmp_path: Path) -> None:
    data = plan_json("--config", preset(tmp_path, f"model: {model}\nsplit: [2, 4]\n"))
    assert (data["model"], data["strategy"], data["split"]) == (str(model), "split", [2, 4])


@pytest.mark.parametrize(
    ("flags", "strategy", "split"),
    [
        (["--split", "1,5"], "split", [1, 5]),  # a flag split replaces the preset's split
        (["--strategy", "even"], "even", [3, 3]),  # a flag strategy replaces the preset's split too
    ],
)
def test_flags_override_the_preset(
    model: Path, tmp_path: Path, flags: list[str], strategy: str, split: list[int]
) -> None:
    data = plan_json("--config", preset(tmp_path, f"model: {model}\nsplit: [2, 4]\n"), *flags)
    assert (data["strategy"], data["split"]) == (strategy, split)


def test_model_flag_overrides_the_preset_model(model: Path, tmp_path: Path) -> None:
    data = plan_json("--config", preset(tmp_path, "model: org/not-used\nstrategy: even\n"), "--model", str(model))
    assert (data["model"], data["strategy"]) == (str(model), "even")


def test_model_flag_drops_the_preset_revision(model: Path) -> None:
    # The preset's strategy (memory) still applies; the local hostfile declares no memory, hence --strategy.
    data = plan_json(
        "--config", str(REPO / "configs" / "llama-3.3-70b-4bit.yaml"), "--model", str(model), "--strategy", "even"
    )
    assert (data["model"], data["commit"]) == (str(model), None)


def test_bad_preset(model: Path, tmp_path: Path) -> None:
    path = preset(tmp_path, "model: x\nsplitt: [1, 5]\n")
    result = invoke("plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--config", path)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"error: {path}: unknown key 'splitt'"


# --- Help ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], ["plan", "Exit codes: 0 success, 1 failure"]),
        (["plan", "--help"], ["--model", "--hostfile", "--split", "--strategy", "--json", "--config"]),
    ],
)
def test_help(args: list[str], expected: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 0
    for text in expected:
        assert text in result.stdout


# --- The installed console script -----------------------------------------------------------


def test_console_script_is_installed() -> None:
    assert MLXPIPE.is_file() and os.access(MLXPIPE, os.X_OK)


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"]])
def test_console_script_help(args: list[str]) -> None:
    proc = mlxpipe(*args)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert "plan" in proc.stdout


def test_console_script_table_and_json(model: Path) -> None:
    table = mlxpipe("plan", "--model", str(model), "--hostfile", str(LOCAL_2))
    assert (table.returncode, table.stderr) == (0, "")
    assert rows(table.stdout) == [("0", "127.0.0.1", "3-5 (3)"), ("1", "127.0.0.1", "0-2 (3)")]
    as_json = mlxpipe("plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--json")
    assert (as_json.returncode, as_json.stderr) == (0, "")
    assert json.loads(as_json.stdout) == expected_json(model, LOCAL_2)


def test_console_script_exit_codes(model: Path, tmp_path: Path) -> None:
    hostfile = write_hostfile(tmp_path / "small.json", [layer_budget(model, 1.5), layer_budget(model, 5.5)])
    not_fitting = mlxpipe("plan", "--model", str(model), "--hostfile", str(hostfile), "--context", str(CONTEXT),
                          "--strategy", "even")
    assert (not_fitting.returncode, not_fitting.stderr.splitlines()[-1]) == (1, "hint: this split fits: --split 1,5")
    bad_split = mlxpipe("plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--split", "4,4")
    assert (bad_split.returncode, bad_split.stdout) == (2, "")
    assert bad_split.stderr.splitlines()[0] == "error: --split 4,4 sums to 8 but the model has 6 layers"
    missing = mlxpipe("plan", "--model", str(model), "--hostfile", "nope.yaml", cwd=tmp_path)
    assert (missing.returncode, missing.stderr) == (
        1, "error: nope.yaml: no such hostfile\nhint: pass --hostfile with an existing file\n",
    )


def test_console_script_debug_shows_the_traceback(model: Path, tmp_path: Path) -> None:
    proc = mlxpipe("--debug", "plan", "--model", str(model), "--hostfile", "nope.yaml", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == "mlxpipe.errors.HostfileError: nope.yaml: no such hostfile"


# --- Lazy imports ---------------------------------------------------------------------------

_PROBE = """
import json, sys
from mlxpipe.cli import app
after_import = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
after_plan = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
sys.stderr.write(json.dumps({"code": code, "after_import": after_import, "after_plan": after_plan}))
"""


def test_plan_does_not_import_mlx(model: Path) -> None:
    heavy = ("mlx", "mlx_lm", "mlx_vlm", "transformers", "torch")
    probe = f"HEAVY = {heavy!r}\n" + _PROBE
    proc = subprocess.run(
        [sys.executable, "-c", probe, "plan", "--model", str(model), "--hostfile", str(LOCAL_2), "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert json.loads(proc.stderr) == {"code": 0, "after_import": [], "after_plan": []}
    assert json.loads(proc.stdout)["split"] == [3, 3]


# --- Layers that share KV caches -------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_shared_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 6-layer Gemma 4 whose last two layers read layer 3's KV cache: layers 3-5 stay together."""
    from fixtures.arch_configs import tiny_config
    from fixtures.tiny_models import write_checkpoint

    config = {**tiny_config("gemma4_text", 6), "num_kv_shared_layers": 2}
    return write_checkpoint(config, tmp_path_factory.mktemp("kv-shared") / "gemma4", num_shards=3)


def test_a_computed_split_keeps_kv_sharing_layers_on_one_rank(kv_shared_model: Path) -> None:
    result = invoke("plan", "--model", str(kv_shared_model), "--hostfile", str(REPO / "hostfiles" / "local-3.json"),
                    "--strategy", "even")  # the balanced split weighs the full-attention layer 1 at a chat's context
    assert result.exit_code == 0, result.output
    # Even would cut at 2 and 4; the cut at 4 moves to 3.
    assert rows(result.stdout) == [
        ("0", "127.0.0.1", "3-5 (3)"), ("1", "127.0.0.1", "2-2 (1)"), ("2", "127.0.0.1", "0-1 (2)"),
    ]
    assert "note: layers 3-5 share KV caches: they run on one rank" in result.stdout


def test_a_split_that_cuts_kv_sharing_layers_is_refused(kv_shared_model: Path) -> None:
    result = invoke("plan", "--model", str(kv_shared_model), "--hostfile", str(LOCAL_2), "--split", "2,4")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        "error: --split 2,4 cuts layers 3-5, which share KV caches and must run on one rank"
    )
    assert "try --split 3,3" in result.stderr


# --- --layout auto: the layouts weighed from the cluster's facts --------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen2 whose layers outweigh the fixed costs of a decode step on a CPU (8 layers, hidden 512)."""
    from fixtures.layouts import build_qwen2

    return build_qwen2(tmp_path_factory.mktemp("wide") / "qwen2", 8)


@pytest.mark.parametrize(("latency", "chosen"), [(5e-5, "tp 2"), (5e-3, "pipeline balanced/even 4,4")])
def test_layout_auto_shows_every_layout_and_plans_the_fastest(wide: Path, tmp_path: Path, latency: float,
                                                              chosen: str) -> None:
    hostfile = tmp_path / "two.json"
    hostfile.write_text(LOCAL_2.read_text())
    facts_beside(hostfile, latency)
    result = invoke("plan", "--model", str(wide), "--hostfile", str(hostfile), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    layouts = data["layouts"]
    assert (layouts["workload"], layouts["chosen"]) == ("chat", chosen)
    assert {c["layout"] for c in layouts["candidates"]} == {"tp 2", "pipeline balanced 4,4"}
    assert data["tp"] == (2 if chosen == "tp 2" else 1)
    table = invoke("plan", "--model", str(wide), "--hostfile", str(hostfile))
    assert table.exit_code == 0, table.output
    assert "layouts for a chat turn (1,000-token prompt, 250 tokens out)" in table.stdout
    assert f"layout: {chosen}: a chat turn (1,000-token prompt, 250 tokens out) is predicted to take" in \
        " ".join(table.stdout.split())


def test_layout_auto_without_facts_says_how_to_measure_them(wide: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "two.json"
    hostfile.write_text(LOCAL_2.read_text())
    quiet = invoke("plan", "--model", str(wide), "--hostfile", str(hostfile), "--json")
    assert "layout_note" not in json.loads(quiet.stdout)  # the default stays the pipeline it always was, quietly
    asked = invoke("plan", "--model", str(wide), "--hostfile", str(hostfile), "--layout", "auto", "--json")
    assert json.loads(asked.stdout)["layout_note"] == (
        f"layout: a pipeline (no two.facts.json beside two.json: links not measured; `mlxpipe doctor --links "
        f"--hostfile {hostfile}` measures them, then --layout auto weighs --tp too)")


@pytest.mark.parametrize(("args", "error"), [
    (["--layout", "auto", "--tp", "2"], "error: --layout auto chooses --tp and the split itself\n"
                                        "hint: give --layout auto, or --tp / --split\n"),
    (["--layout", "best"], "error: --layout 'best': use one of auto, pipeline\n"),
    (["--workload", "chatty"], "error: --workload 'chatty': use one of chat, agent, batch\n"),
])
def test_layout_flags_are_refused_by_name(model: Path, args: list[str], error: str) -> None:
    result = invoke("plan", "--model", str(model), *args)
    assert result.exit_code == 2
    assert result.stderr == error
