"""A CLI that tells the truth: defaults in every --help, examples that parse, exit codes, docs/cli.md.

Everything here runs before any rank is launched: help pages, parsing, and the checks a
command makes before it starts (flags, the plan's fit), through Typer's runner.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from fixtures.fake_hub import FakeHub
from fixtures.tiny_models import make_tiny_checkpoint
from mlxpipe.cli import VERSIONED, app
from mlxpipe.cli import reference as cli_reference
from mlxpipe.cluster.hostfile import BACKENDS
from mlxpipe.cluster.presets import load_preset
from mlxpipe.defaults import DEFAULT_PORT
from mlxpipe.host import GB
from mlxpipe.protocol.request import DEFAULT_MAX_TOKENS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
REFERENCE = REPO / "docs" / "cli.md"
# The pages whose examples are checked: the README and every page of docs/ but the generated reference.
PAGES = [README] + sorted(page for page in (REPO / "docs").glob("*.md") if page != REFERENCE)
# Files that examples name and that must ship with the repo (prompts files and outputs are the user's).
REPO_FILE = re.compile(r"^(hostfiles|configs|fleets)/")
# A command line in a page: at the start of a code line, possibly as .venv/bin/mlxpipe.
PAGE_COMMAND = re.compile(r"^(\S*/)?mlxpipe\s")
INLINE_CODE = re.compile(r"`(mlxpipe [^`]*)`")
CLICK_ERROR_BOX = re.compile(r"[│╭╮╰╯─]")


def invoke(*args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(app, list(args), input=input, prog_name="mlxpipe")


def click_error(stderr: str) -> str:
    """The sentence in the box Typer draws around a usage error, unwrapped."""
    text = " ".join(CLICK_ERROR_BOX.sub(" ", stderr).split())
    return text.split(" Error ", 1)[1]


# --- Defaults in every --help -----------------------------------------------------------------


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """Every help page at the reference's width, as docs/cli.md shows it."""
    return cli_reference.help_pages()


@pytest.fixture(scope="module")
def wide_pages() -> dict[str, str]:
    """Every help page at a width where no option's help wraps: one option, one line."""
    return cli_reference.help_pages(width=400)


def command_of(command: list[str]) -> tuple[Any, Any]:
    """``mlxpipe COMMAND`` (``["cluster", "init"]`` inside its group) and a context to read it with."""
    cmd = get_command(app)
    ctx = cmd.make_context("mlxpipe", [], resilient_parsing=True)
    for name in command:
        cmd = cmd.get_command(ctx, name)  # type: ignore[attr-defined]
    return cmd, ctx


def options_with_values(command: list[str]) -> list[Any]:
    """The options of ``mlxpipe COMMAND`` that take a value (flags are off unless given: no default to show)."""
    cmd, _ = command_of(command)
    return [p for p in cmd.params if p.param_type_name == "option" and not p.is_flag]


def option_line(page: str, flag: str) -> str:
    """The one line of a wide help page that describes ``flag``."""
    lines = [line for line in page.splitlines() if re.match(rf"│ {re.escape(flag)}\s", line)]
    assert len(lines) == 1, (flag, lines)
    return " ".join(lines[0].strip("│ ").split())


def test_every_option_with_a_value_shows_its_default(pages: dict[str, str]) -> None:
    for title, page in pages.items():
        options = options_with_values(title.split()[1:])
        # Rich markup would swallow a hand-written "[default: ...]": count what is actually printed.
        assert page.count("[default: ") == len(options), title
        for option in options:
            assert option.default is not None or isinstance(option.show_default, str), (title, option.opts)


@pytest.mark.parametrize(
    ("command", "flag", "shown"),
    [
        ("generate", "--max-tokens", f"[default: ({DEFAULT_MAX_TOKENS}, or the --config preset's)]"),
        ("chat", "--max-tokens", f"[default: ({DEFAULT_MAX_TOKENS}, or the --config preset's)]"),
        ("serve", "--max-tokens", f"[default: ({DEFAULT_MAX_TOKENS}, or the --config preset's)]"),
        ("generate", "--temp", "[default: (0, or the --config preset's)]"),
        ("generate", "--top-p", "[default: (1, or the --config preset's)]"),
        ("generate", "--min-p", "[default: (0, or the --config preset's)]"),
        ("generate", "--port", f"[default: ({DEFAULT_PORT}; a free one when every rank is local)]"),
        ("serve", "--ring-port", f"[default: ({DEFAULT_PORT}; a free one when every rank is local)]"),
        ("serve", "--port", "[default: 8080]"),
        ("doctor", "--port", f"[default: ({DEFAULT_PORT}; unchecked when every rank is local)]"),
        ("plan", "--hostfile", "[default: (hostfiles/local-2.json: two local ranks)]"),
        ("plan", "--context", "[default: 4096]"),
        ("generate", "--prefill-step-size", "[default: (128 on a pipeline of 2 or more ranks, else mlx-lm's 2048)]"),
        ("generate", "--timeout", "[default: 120.0]"),
    ],
)
def test_the_default_shown_is_the_one_used(wide_pages: dict[str, str], command: str, flag: str, shown: str) -> None:
    assert option_line(wide_pages[f"mlxpipe {command}"], flag).endswith(shown)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "doctor"])
def test_backend_help_names_every_backend(wide_pages: dict[str, str], command: str) -> None:
    line = option_line(wide_pages[f"mlxpipe {command}"], "--backend")
    named = re.findall(r"\b([a-z][a-z-]*) \(", line.split("backend:", 1)[1]) + ["mpi"]
    assert sorted(set(named) & set(BACKENDS)) == sorted(BACKENDS)


def flags(command: list[str]) -> list[Any]:
    """The boolean flags of ``mlxpipe COMMAND`` (``--help`` included)."""
    cmd, ctx = command_of(command)
    return [p for p in cmd.get_params(ctx) if p.param_type_name == "option" and p.is_flag]


def test_flags_show_no_type(wide_pages: dict[str, str]) -> None:
    # A flag takes no value, so nothing stands between it and its help; typer 0.29.0's Rich help
    # printed "<bool>" there (pyproject.toml keeps it out).
    for title, page in wide_pages.items():
        found = flags(title.split()[1:])
        assert any(flag.opts == ["--help"] for flag in found), title
        for flag in found:
            line = option_line(page, flag.opts[0])
            assert line.split(flag.help.split()[0], 1)[0].split() == [*flag.opts, *flag.secondary_opts], (title, line)


# --- Every example parses, and names files that exist -------------------------------------------


def help_examples() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for every ``Example:`` line in the app's and each command's help."""
    commands = [(" ".join(names) or "mlxpipe", command_of(names)[0]) for names in cli_reference.commands()]
    found = []
    for name, cmd in commands:
        for line in (cmd.help or "").splitlines():
            if line.strip().startswith("Example:"):
                found.append((f"{name} --help", command_argv(line.split("Example:", 1)[1])))
    return found


def page_commands(text: str, name: str) -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for every mlxpipe command line in a page's code (fenced, indented or inline).

    ``name`` is the page's path from the repo root; ``where`` is ``name:line``.
    """
    found: list[tuple[str, list[str]]] = []
    fenced = False
    pending: tuple[int, str] | None = None  # a command line continued with a backslash
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        code = line if fenced else line[4:] if line.startswith("    ") else None
        if code is None:
            found += [(f"{name}:{number}", command_argv(span)) for span in INLINE_CODE.findall(line)
                      if "--" in span and "..." not in span]
            continue
        if pending is not None:
            start, joined = pending
            code, pending = joined + " " + code.strip(), None
        elif PAGE_COMMAND.match(code.strip()):
            start = number
        else:
            continue
        if code.rstrip().endswith("\\"):
            pending = (start, code.rstrip()[:-1])
        else:
            found.append((f"{name}:{start}", command_argv(code)))
    return found


def command_argv(line: str) -> list[str]:
    """The arguments of one shell command line: no program name, comment or redirection."""
    words = shlex.split(line, comments=True)
    assert words and (words[0] == "mlxpipe" or words[0].endswith("/mlxpipe")), line
    words = words[1:]
    redirect = next((i for i, w in enumerate(words) if w[0] in "<>|"), len(words))
    return words[:redirect]


def parse(argv: list[str]) -> Any:
    """Parse ``mlxpipe ARGV`` with the real app, converting and checking every value, running nothing
    (through a group such as ``cluster`` to its command)."""
    group = get_command(app)
    ctx = group.make_context("mlxpipe", [], resilient_parsing=True)
    while True:
        at = next(i for i, word in enumerate(argv) if not word.startswith("-"))
        cmd = group.get_command(ctx, argv[at])  # type: ignore[attr-defined]
        assert cmd is not None, f"no command {argv[at]!r}"
        if not hasattr(cmd, "list_commands"):
            return cmd.make_context(argv[at], argv[at + 1:], parent=ctx)
        group, ctx, argv = cmd, cmd.make_context(argv[at], [], parent=ctx, resilient_parsing=True), argv[at + 1:]


def docs_examples() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for every mlxpipe command line in the README and docs/ (docs/cli.md aside)."""
    return [found for page in PAGES for found in page_commands(page.read_text(), page.relative_to(REPO).as_posix())]


EXAMPLES = help_examples() + docs_examples()


def test_the_examples_are_found() -> None:
    # The extractors themselves: each command's examples, a line continued with a backslash,
    # a redirection dropped, an inline span; each page named in `where`.
    assert {where for where, _ in help_examples()} == {
        "plan --help", "download --help", "generate --help", "serve --help", "lora --help", "doctor --help",
        "cluster discover --help", "cluster init --help", "cluster install --help",
    }
    names = [page.relative_to(REPO).as_posix() for page in PAGES]
    assert "README.md" in names and "docs/serve.md" in names and "docs/cli.md" not in names
    by_page: dict[str, list[list[str]]] = {}
    for where, argv in docs_examples():
        by_page.setdefault(where.rsplit(":", 1)[0], []).append(argv)
    assert [
        "generate", "--model", "mlx-community/Llama-3.3-70B-Instruct-4bit",
        "--hostfile", "hostfiles/mac-studio-2-thunderbolt.json", "--prompt", "Write a haiku about Thunderbolt cables",
    ] in by_page["README.md"]
    assert [
        "generate", "--config", "configs/llama-3.3-70b-4bit.yaml",
        "--hostfile", "hostfiles/mac-studio-2-thunderbolt.json",
        "--prompt", "-",
    ] in by_page["docs/generate.md"]
    assert ["plan", "--json"] in by_page["docs/benchmarks.md"]
    for page in ["docs/generate.md", "docs/serve.md", "docs/lora.md"]:
        assert by_page.get(page), f"no example found in {page}"


@pytest.mark.parametrize(("where", "argv"), EXAMPLES, ids=[f"{w}:{' '.join(a[:1])}" for w, a in EXAMPLES])
def test_example_parses_and_names_files_that_exist(where: str, argv: list[str]) -> None:
    with parse(argv) as ctx:
        assert (shlex.join(["mlxpipe", *argv]) + " ").startswith(ctx.command_path + " ")  # "mlxpipe cluster init ..."
        if ctx.params.get("config") is not None:
            load_preset(REPO / ctx.params["config"])  # a preset an example names must load, not just exist
    missing = [word for word in argv if REPO_FILE.match(word) and not (REPO / word).is_file()]
    assert missing == [], f"{where}: {missing}"


def test_a_bad_example_would_be_caught() -> None:
    # What the test above relies on: parsing refuses unknown flags and bad values.
    for argv, error in [
        (["plan", "--hostfiles", "x"], "No such option: --hostfiles"),
        (["generate", "--max-tokens", "many"], "Invalid value for '--max-tokens'"),
        (["serve", "--ring-port", "0"], "Invalid value for '--ring-port': 0 is not a TCP port (1-65535)"),
    ]:
        with pytest.raises(Exception) as caught:
            parse(argv)
        # The rest of the sentence is typer's and varies between its versions.
        assert caught.value.format_message().startswith(error)  # type: ignore[attr-defined]


@pytest.fixture
def llama_on_the_hub(hub_env: FakeHub, tmp_path: Path) -> Iterator[str]:
    """The docs' 70B repo id, served by the fake hub as a tiny 6-layer llama (metadata is all plan reads); the
    shipped fleet's two models as tiny qwen2s."""
    repo = "mlx-community/Llama-3.3-70B-Instruct-4bit"
    hub_env.add_repo(repo, make_tiny_checkpoint("llama", tmp_path / "llama"))
    for i, fleet_model in enumerate(("mlx-community/Qwen3-4B-Instruct-2507-4bit",
                                     "mlx-community/Qwen2.5-0.5B-Instruct-4bit")):
        hub_env.add_repo(fleet_model, make_tiny_checkpoint("qwen2", tmp_path / f"fleet-{i}"))
    yield repo


PLAN_EXAMPLES = [(where, argv) for where, argv in EXAMPLES if argv[0] == "plan" and len(argv) > 2]


@pytest.mark.parametrize(("where", "argv"), PLAN_EXAMPLES, ids=[where for where, _ in PLAN_EXAMPLES])
def test_plan_examples_run(llama_on_the_hub: str, monkeypatch: pytest.MonkeyPatch, where: str,
                           argv: list[str]) -> None:
    monkeypatch.chdir(REPO)  # examples name hostfiles relative to the repo
    result = invoke(*argv, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    if "--tp" in argv:  # groups of --tp hosts, one stage each (docs/tensor-parallel.md)
        tp = int(argv[argv.index("--tp") + 1])
        assert (data["model"], data["tp"], len(data["split"]), sum(data["split"])) == (
            llama_on_the_hub, tp, len(data["ranks"]) // tp, 6)
        assert [(r["stage"], r["tp_index"]) for r in data["ranks"]] == [
            (i // tp, i % tp) for i in range(len(data["ranks"]))]
        return
    if "--fleet" in argv:  # fleets/local-3.yaml: two ranks of one model, the third of another
        assert [len(p["plan"]["ranks"]) for p in data["pipelines"]] == [2, 1] and data["fits"]
        return
    assert (data["model"], data["split"], [r["host"] for r in data["ranks"]]) == (
        llama_on_the_hub, [3, 3], ["studio-1.local", "studio-2.local"],
    )


# --- Flags checked before anything runs ---------------------------------------------------------

# Commands with every value they need, so that only the flag under test is wrong; --model is never
# read before the flags are checked, and chat would read its first message from standard input.
LAUNCHING = {
    "generate": ["generate", "--model", "unread", "--prompt", "hi"],
    "chat": ["chat", "--model", "unread"],
    "serve": ["serve", "--model", "unread"],
    "doctor": ["doctor"],
}


@pytest.mark.parametrize(
    ("command", "flag"),
    [("generate", "--port"), ("chat", "--port"), ("serve", "--port"), ("serve", "--ring-port"), ("doctor", "--port")],
)
@pytest.mark.parametrize("value", ["0", "65536"])
def test_port_is_checked_and_named(command: str, flag: str, value: str) -> None:
    result = invoke(*LAUNCHING[command], flag, value, input="")
    assert result.exit_code == 2
    assert click_error(result.stderr) == f"Invalid value for '{flag}': {value} is not a TCP port (1-65535)"


@pytest.mark.parametrize("command", list(LAUNCHING))
def test_backend_is_checked_and_named(command: str) -> None:
    result = invoke(*LAUNCHING[command], "--backend", "tcp", input="")
    assert result.exit_code == 2
    assert click_error(result.stderr) == f"Invalid value for '--backend': 'tcp': use one of {', '.join(BACKENDS)}"


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-tokens", "0", "--max-tokens must be at least 1, got 0"),
        ("-n", "-3", "--max-tokens must be at least 1, got -3"),
        ("--temp", "-0.5", "--temp must be >= 0, got -0.5"),
        ("--top-p", "0", "--top-p must be in (0, 1], got 0"),
        ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
        ("--min-p", "1", "--min-p must be in [0, 1), got 1"),
    ],
)
def test_bad_sampling_flag_is_named(command: str, flag: str, value: str, message: str) -> None:
    result = invoke(*LAUNCHING[command], flag, value, input="")
    assert (result.exit_code, result.stderr) == (2, f"error: {message}\n")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [("temp", "-1", ">= 0, got -1"), ("top_p", "0", "in (0, 1], got 0"), ("max_tokens", "0", "at least 1, got 0")],
)
def test_bad_sampling_value_in_a_preset_names_the_file_not_a_flag(
    tmp_path: Path, command: str, key: str, value: str, expected: str
) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"generate:\n  {key}: {value}\n")
    result = invoke(*LAUNCHING[command], "--config", str(preset), input="")
    assert (result.exit_code, result.stderr) == (1, f"error: {preset}: key '{key}' must be {expected}\n")


def test_bad_serve_max_tokens_is_named() -> None:
    result = invoke(*LAUNCHING["serve"], "--max-tokens", "0")
    assert (result.exit_code, result.stderr) == (2, "error: --max-tokens must be at least 1, got 0\n")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag", ["--temp", "--top-p", "--min-p", "--seed", "--max-tokens"])
def test_sampling_flag_that_is_not_a_number_is_named(command: str, flag: str) -> None:
    result = invoke(*LAUNCHING[command], flag, "warm", input="")
    assert result.exit_code == 2
    # What follows the flag is typer's wording, which varies between its versions.
    assert click_error(result.stderr).startswith(f"Invalid value for '{flag}'")


# --- A plan that does not fit: exit 1, whatever the command -----------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fit") / "llama")


@pytest.fixture
def too_small(tmp_path: Path) -> Path:
    """Two local ranks whose GPUs may wire 100 KiB: the tiny model (1 MiB) fits on neither."""
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "memory_gb": 8, "wired_limit_gb": 100 * 1024 / GB}] * 2
    path = tmp_path / "too-small.json"
    path.write_text(json.dumps(hosts))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--prompt", "hi"],
        ["chat"],
        ["serve", "--port", "PORT"],
        ["download", "--from-controller", "--dry-run"],
    ],
    ids=lambda args: args[0],
)
def test_does_not_fit_exits_1_before_launch(tiny_model: Path, too_small: Path, args: list[str]) -> None:
    args = [str(free_port()) if a == "PORT" else a for a in args]
    result = invoke(*args, "--model", str(tiny_model), "--hostfile", str(too_small), input="")
    assert (result.exit_code, result.stderr) == (1, "error: rank 0 (127.0.0.1) cannot hold layers 3-5\n"
                                                    "hint: see `mlxpipe plan`\n")


def test_does_not_fit_exits_1_in_plan(tiny_model: Path, too_small: Path) -> None:
    result = invoke("plan", "--model", str(tiny_model), "--hostfile", str(too_small))
    assert result.exit_code == 1
    assert result.stderr.startswith("error: rank 0 (127.0.0.1), rank 1 (127.0.0.1) cannot hold its share")


def test_does_not_fit_exits_1_in_doctor(tiny_model: Path, too_small: Path) -> None:
    result = invoke("doctor", "--model", str(tiny_model), "--hostfile", str(too_small), "--json")
    assert result.exit_code == 1
    failed = [(c["check"], c["ranks"]) for c in json.loads(result.stdout)["checks"] if c["status"] != "ok"]
    assert failed == [("memory", [0, 1])]


# --- docs/cli.md is what the app prints ----------------------------------------------------------


def test_reference_is_up_to_date() -> None:
    # typer and Rich draw the pages: a new version of either may change them as much as a new flag does.
    assert REFERENCE.read_text() == cli_reference.reference(), (
        f"docs/cli.md is stale: run `{cli_reference.REGENERATE}` "
        f"(rendered here with typer {version('typer')}, rich {version('rich')})"
    )


def test_reference_has_every_command_plain_and_at_its_width(pages: dict[str, str]) -> None:
    text = REFERENCE.read_text()
    assert list(pages) == ["mlxpipe", "mlxpipe plan", "mlxpipe download", "mlxpipe generate", "mlxpipe chat",
                           "mlxpipe serve", "mlxpipe lora", "mlxpipe demo-model", "mlxpipe doctor", "mlxpipe cluster",
                           "mlxpipe cluster discover", "mlxpipe cluster init", "mlxpipe cluster install"]
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == list(pages)
    assert "\x1b" not in text  # no colour or style codes
    assert max(len(line) for page in pages.values() for line in page.splitlines()) == cli_reference.WIDTH


def test_readme_links_the_reference() -> None:
    assert "[docs/cli.md](docs/cli.md)" in README.read_text()


# --- --version, and what the help costs ----------------------------------------------------------

# The modules `mlxpipe --help` may load besides cli/: the shared leaves. Planning, launching and
# serving come in only when a command runs (their defaults are in mlxpipe.defaults).
LEAVES = ("errors", "console", "paths", "request", "prompts", "protocol", "defaults", "host")
HEAVY = ("mlx", "mlx_lm", "transformers")


def test_version_names_mlxpipe_mlx_and_mlx_lm() -> None:
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"{name} {version(name)}" for name in ("mlxpipe", "mlx", "mlx-lm")]
    assert VERSIONED == ("mlxpipe", "mlx", "mlx-lm")


def modules_loaded_by(args: list[str], tmp_path: Path) -> tuple[int, list[str]]:
    """``mlxpipe ARGS`` run in a fresh interpreter: its exit status and every module it loaded (written as ``main``
    leaves, which it does without Python's exit: ``cli.leave``)."""
    out = tmp_path / "modules.json"
    script = "\n".join([
        "import json, sys",
        f"sys.argv = {['mlxpipe', *args]!r}",
        "from mlxpipe import cli",
        "def leave(code):",
        f"    open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules)))",
        "    sys.exit(code)",
        "cli.leave = leave",
        "cli.main()",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, json.loads(out.read_text())


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["serve", "--help"], ["generate", "--help"]])
def test_help_loads_only_the_command_line_and_the_leaves(tmp_path: Path, args: list[str]) -> None:
    code, modules = modules_loaded_by(args, tmp_path)
    assert code == 0
    ours = [m for m in modules if m.split(".")[0] == "mlxpipe"]
    # A leaf may be a package of leaves (the wire's protocol/): its modules count as the leaf.
    allowed = ("cli", *LEAVES)
    assert [m for m in ours if m != "mlxpipe" and m.split(".")[1] not in allowed] == []
    assert "mlxpipe.cli.serve" in ours  # every command's module is there: the check sees what the app loads
    assert [m for m in modules if m.split(".")[0] in HEAVY] == []
