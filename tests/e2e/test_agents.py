"""The coding agents' own clients against ``mlxpipe serve`` on 2 ranks: Claude Code and Codex, as users run them.

Claude Code runs in print mode (``claude -p``) with its default system prompt and tools, pointed at the server by
``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` in a fresh HOME; Codex runs ``codex exec`` through a custom model
provider with ``wire_api = "responses"`` in a fresh ``CODEX_HOME``. Each must finish its turn (exit 0) and print
the model's reply: the tiny model (``agent_model``) answers one sentence, ``AGENT_REPLY``, and ends its turn. A proxy
between them (``fixtures.agents.RecordingProxy``) records what the agent sent and what the server streamed back:
the fields that broke these agents before (a system message inside ``messages``, ``namespace`` and hosted tools,
``developer`` messages) are checked to be there, so that a new client version that stops sending them is noticed,
and the server's line for each request must say what it left out or mapped.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.agents import AGENT_REPLY, AgentClis, RecordingProxy
from fixtures.serve_process import KEY, ServeProcess, ready_server

pytestmark = pytest.mark.ranks

ALIAS = "local-model"  # Codex's configured model name: an alias by --served-model-name
AGENT_SECONDS = 300


@pytest.fixture(scope="module")
def agents_server(agent_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The agents' model on 2 local ranks, answering to ``ALIAS`` and to any name Claude Code asks for."""
    with ready_server(["--model", str(agent_model), "--hostfile", "hostfiles/local-2.json", "--served-model-name",
                       ALIAS, "--any-model-name"],
                      tmp_path_factory.mktemp("agents-serve-home"), env={"MLXPIPE_API_KEY": KEY}) as proc:
        yield proc


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return subprocess.run(command, env={**base, **env}, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=AGENT_SECONDS)


def test_claude_code_finishes_a_turn(agent_clis: AgentClis, recording_proxy: RecordingProxy,
                                     agents_server: ServeProcess, tmp_path: Path) -> None:
    home, work = tmp_path / "claude-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": recording_proxy.base, "ANTHROPIC_API_KEY": KEY,
           # Nothing but the server: no telemetry, no update checks.
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    result = _run([str(agent_clis.claude), "-p", "Say hello."], env, work)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{agents_server.stderr[-3000:]}"
    [turn] = recording_proxy.posts("/v1/messages")
    body = turn.body
    # What it sent that this server refused before: a system message among the messages; and what it cannot
    # honour: its own model name, adaptive thinking, server-side context editing, a beta query string.
    assert any(m["role"] == "system" for m in body["messages"]), body["messages"]
    assert len(body["tools"]) > 10 and turn.path.endswith("?beta=true") and body["model"] != ALIAS
    assert body["thinking"] and body["context_management"] and body["stream"]
    assert turn.status == 200, turn.answer[-2000:]
    text = "".join(e["delta"]["text"] for e in turn.events() if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert text == AGENT_REPLY and result.stdout.strip() == AGENT_REPLY, result.stdout
    # The server's line for it says what was mapped or left out (its max_tokens, more than the context
    # leaves, clamped), and the name it answered.
    assert f"model name {body['model']!r} answered by" in agents_server.stderr
    line = _request_line(agents_server, "anthropic", "context_management not applied")
    assert f"max_tokens {body['max_tokens']} -> " in line and "thinking adaptive" in line


def _codex_config(home: Path, base: str, model: str | None = ALIAS) -> None:
    home.mkdir()
    (home / "config.toml").write_text((f'model = "{model}"\n' if model else "") + f'''model_provider = "mlxpipe"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.mlxpipe]
name = "mlxpipe"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "MLXPIPE_API_KEY"
''')


def test_codex_finishes_a_turn(agent_clis: AgentClis, recording_proxy: RecordingProxy, agents_server: ServeProcess,
                               tmp_path: Path) -> None:
    home, codex_home, work = tmp_path / "codex-user", tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    _codex_config(codex_home, recording_proxy.base)
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home), "MLXPIPE_API_KEY": KEY}
    last = tmp_path / "last-message.txt"
    result = _run([str(agent_clis.codex), "exec", "--skip-git-repo-check", "-o", str(last), "Say hello."], env, work)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{agents_server.stderr[-3000:]}"
    [turn] = recording_proxy.posts("/v1/responses")
    body = turn.body
    # What it sent that this server refused before: a namespace of functions, a hosted web search, developer
    # messages, reasoning, and what only OpenAI's servers keep.
    kinds = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds, kinds
    assert any(i.get("role") == "developer" for i in body["input"])
    assert body["model"] == ALIAS and "reasoning" in body and body["store"] is False and "prompt_cache_key" in body
    assert turn.status == 200, turn.answer[-2000:]
    events = turn.events()
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert text == AGENT_REPLY == last.read_text().strip() and AGENT_REPLY in result.stdout, result.stdout
    assert _request_line(agents_server, "responses", "built-in tools left out (only function tools reach the model): "
                                                     "web_search")


def test_codex_with_its_own_default_model_finishes_a_turn(agent_clis: AgentClis, recording_proxy: RecordingProxy,
                                                           agents_server: ServeProcess, tmp_path: Path) -> None:
    """No ``model`` line: Codex asks for its default model, in that model's shape (its tools in an
    ``additional_tools`` input item, ``custom`` tools with a grammar), which ``--any-model-name`` answers."""
    home, codex_home, work = tmp_path / "codex-user", tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    _codex_config(codex_home, recording_proxy.base, model=None)
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home), "MLXPIPE_API_KEY": KEY}
    result = _run([str(agent_clis.codex), "exec", "--skip-git-repo-check", "Say hello."], env, work)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{agents_server.stderr[-3000:]}"
    [turn] = recording_proxy.posts("/v1/responses")
    assert turn.body["model"] != ALIAS and turn.status == 200, turn.answer[-2000:]
    tools = [t for i in turn.body["input"] if i.get("type") == "additional_tools" for t in i["tools"]]
    assert any(sub["type"] == "custom" for t in tools for sub in t.get("tools", [])), tools
    assert AGENT_REPLY in result.stdout, result.stdout
    assert _request_line(agents_server, "responses", "custom tools offered as functions of one string")


def _request_line(server: ServeProcess, door: str, saying: str) -> str:
    """The server's line for the last request through ``door``, which must say ``saying``."""
    lines = [line for line in server.stderr.splitlines() if f" ({door}): " in line and "tok/s" in line]
    assert lines and saying in lines[-1], lines[-3:]
    return lines[-1]
