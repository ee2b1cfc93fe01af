"""A distributed run that goes wrong: real ranks on this machine and on the ssh test cluster.

torchrun is the model: one failure stops every rank, the root cause comes
first (host, rank, exit status or exception), signals to the controller stop
every rank on every host, and nothing is left running anywhere. Ranks are
started only by the tests about ranks; the controller runs as a real
``mlxpipe generate`` subprocess where signals and exit statuses matter. The model is ``chat_model`` (the
demo's tokenizer and 8 layers each in its own shard, on tiny random weights): the failures are of ranks,
hosts and processes, not of the weights, and it loads and runs in a fraction of the demo's time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fixtures import faulty_worker
from fixtures.cluster import Cluster
from fixtures.doctor import OTHER_MLX
from fixtures.hostfiles import LOCAL
from fixtures.processes import _alive, _is_worker, local_rank_processes
from mlxpipe.cli import app
from mlxpipe.errors import LaunchError
from mlxpipe.launch.pipeline import Pipeline, Request, request_for

REPO = Path(__file__).resolve().parents[2]
MLXPIPE = str(Path(sys.executable).parent / "mlxpipe")
# A raw prompt of a few tokens: the first token comes quickly and the story (chat_model's greedy words, never its
# end-of-sequence token within these 400) goes on for longer than any test waits.
STORY = "Once upon a time"
STORY_SAMPLING = Request(max_tokens=400, ignore_chat_template=True)
START_SECONDS = 120.0  # starting ranks on a busy 2-core machine


# --- Where the ranks run ---------------------------------------------------------------------


@dataclass
class Site:
    """Two ranks on 127.0.0.1, or on two hosts of the ssh cluster."""

    hostfile: Path
    hosts: list[str]
    cluster: Cluster | None = None

    def worker_pid(self, rank: int, root: int) -> int:
        """The pid of rank ``rank``'s worker (below ``root`` when local)."""
        if self.cluster is not None:
            pids = [p.pid for p in self.cluster.ps_on(rank) if _is_worker(p.cmdline)]
        else:
            pids = [pid for pid, (r, c) in local_rank_processes(root).items() if r == rank and _is_worker(c)]
        assert len(pids) == 1, pids
        return pids[0]

    def rank_pids(self, root: int) -> set[int]:
        """Every supervisor and worker of the run, on every host."""
        if self.cluster is not None:
            return {p.pid for i in range(len(self.hosts)) for p in self.cluster.ps_on(i)}
        return set(local_rank_processes(root))

    def wait_gone(self, pids: set[int], timeout: float) -> set[int]:
        """Wait until none of ``pids`` (and, on the cluster, no process on any host) is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = {p for p in pids if _alive(p)}
            if self.cluster is not None:
                left |= {p.pid for procs in self.cluster.leftovers().values() for p in procs}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)


@pytest.fixture
def site(request: pytest.FixtureRequest, chat_model: Path, tmp_path: Path) -> Site:
    if request.param == "local":
        path = tmp_path / "local-2.json"
        path.write_text(json.dumps([LOCAL, LOCAL]))
        return Site(path, ["127.0.0.1", "127.0.0.1"])
    cluster: Cluster = request.getfixturevalue("cluster")
    # Outside the wiped per-test caches: each host keeps its model files across the session.
    path = cluster.hostfile(2, model_dir=lambda h: h.dir / "models")
    return Site(path, cluster.hosts[:2], cluster)


LOCAL_AND_SSH = [pytest.param("local"), pytest.param("ssh", marks=pytest.mark.cluster)]


# --- The controller as a subprocess ------------------------------------------------------------


class Controller:
    """``mlxpipe generate`` running as a subprocess; its output read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [MLXPIPE, "generate", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=REPO, env=dict(os.environ),
        )
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.local_ranks: set[int] = set()
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: Any, sink: bytearray) -> None:
        while chunk := stream.read1(4096):
            sink.extend(chunk)

    def wait_for_text(self, timeout: float = START_SECONDS) -> None:
        """Until rank 0 has streamed some of the answer: generation is under way."""
        deadline = time.monotonic() + timeout
        while not self.stdout.strip():
            assert self.proc.poll() is None, f"generate ended early ({self.proc.returncode}):\n{self.err}"
            assert time.monotonic() < deadline, f"no token after {timeout} s:\n{self.err}"
            time.sleep(0.05)
        self.local_ranks = set(local_rank_processes(self.proc.pid))

    def wait(self, timeout: float) -> tuple[int, float]:
        """The exit status and how long it took."""
        start = time.monotonic()
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=5)
        return code, time.monotonic() - start

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")

    @property
    def error_line(self) -> str:
        lines = [line for line in self.err.splitlines() if line.startswith("error: ")]
        assert lines, self.err
        return lines[0]

    @property
    def run_dir(self) -> Path:
        m = re.search(r"logs: (\S+)", self.err) or re.search(r"starting \d+ ranks: (\S+)/command\.txt", self.err)
        assert m, self.err
        return Path(m.group(1))

    def cleanup(self) -> None:
        """After a failed assertion: nothing of this run may outlive the test (the cluster cleans itself)."""
        ranks = self.local_ranks | set(local_rank_processes(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def controller() -> Iterator[Callable[..., Controller]]:
    started: list[Controller] = []

    def start(*args: str) -> Controller:
        started.append(Controller(*args))
        return started[-1]

    yield start
    for c in started:
        c.cleanup()


def generate_args(site: Site, model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--hostfile", str(site.hostfile), "--prompt", STORY,
            "--ignore-chat-template", "--max-tokens", str(STORY_SAMPLING.max_tokens), *extra]


def event_lines(path: Path) -> list[dict[str, Any]]:
    from mlxpipe.protocol.wire import parse_event

    return [e for e in map(parse_event, path.read_text().splitlines()) if e is not None]


# --- A rank dies ---------------------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.parametrize("site, rank", [("local", 1), pytest.param("ssh", 0, marks=pytest.mark.cluster)],
                         indirect=["site"], ids=["local", "ssh"])
def test_killed_rank_is_the_root_cause(site: Site, rank: int, chat_model: Path, controller: Any) -> None:
    run = controller(*generate_args(site, chat_model))
    run.wait_for_text()
    pids = site.rank_pids(run.proc.pid)
    os.kill(site.worker_pid(rank, run.proc.pid), signal.SIGKILL)
    code, _ = run.wait(timeout=30)  # found as it happened: the watchdog would take 120 s

    assert code == 1, run.err
    # The killed rank, not the peer that noticed its death ("[ring] connection to a peer was lost").
    assert run.error_line == f"error: rank {rank} on {site.hosts[rank]}: killed by SIGKILL (exit status -9)"
    assert site.wait_gone(pids, timeout=5) == set()
    # Each rank's own log, kept in the run directory the hint names.
    logs = {r: run.run_dir / f"rank-{r}.log" for r in (0, 1)}
    assert f"logs: {run.run_dir} (rank-{rank}.log)" in run.err
    for r, log in logs.items():
        events = event_lines(log)
        assert {e["rank"] for e in events} == {r}
        assert [e["event"] for e in events][:2] == ["started", "loaded"]
    [exited] = [e for e in event_lines(logs[rank]) if e["event"] == "exited"]
    assert (exited["returncode"], exited["signal"], exited["stopped"]) == (-9, "SIGKILL", None)


@pytest.mark.ranks
def test_stopped_rank_is_found_in_seconds_and_is_the_root_cause(chat_model: Path, tmp_path: Path,
                                                                 controller: Any) -> None:
    """``kill -STOP`` of a worker (a frozen Mac, a stuck driver): it stops beating, and its supervisor kills it
    after ``WORKER_SILENCE_SECONDS``, where the watchdog on progress (``--timeout``, 600 s here) would wait."""
    from mlxpipe.launch.supervisor import WORKER_SILENCE_SECONDS

    site = Site(tmp_path / "local-2.json", ["127.0.0.1"] * 2)
    site.hostfile.write_text(json.dumps([LOCAL, LOCAL]))
    run = controller(*generate_args(site, chat_model, "--timeout", "600"))
    run.wait_for_text()
    pids = site.rank_pids(run.proc.pid)
    os.kill(site.worker_pid(1, run.proc.pid), signal.SIGSTOP)
    code, _ = run.wait(timeout=60)
    assert code == 1, run.err
    assert run.error_line == (f"error: rank 1 on {site.hosts[1]}: its worker stopped answering: no word from it for "
                              f"{WORKER_SILENCE_SECONDS:g} s, though its host still answers; it was killed")
    assert site.wait_gone(pids, timeout=5) == set()
    [exited] = [e for e in event_lines(run.run_dir / "rank-1.log") if e["event"] == "exited"]
    assert (exited["signal"], exited["stopped"]) == ("SIGKILL", "silent")


@pytest.mark.ranks
@pytest.mark.parametrize("site", ["local"], indirect=True)
def test_killed_rank_mid_batch_keeps_the_finished_results(site: Site, chat_model: Path, tmp_path: Path,
                                                          controller: Any) -> None:
    prompts = tmp_path / "prompts.jsonl"
    quick = {"prompt": "What is the capital of France?", "max_tokens": 4}
    long = {"prompt": STORY, "ignore_chat_template": True, "max_tokens": 400}
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (quick, quick, long, long)))
    out = tmp_path / "results.jsonl"
    out.write_text("an earlier run's results\n")
    partial = tmp_path / "results.jsonl.partial"
    run = controller("--model", str(chat_model), "--hostfile", str(site.hostfile), "--prompts-file", str(prompts),
                     "--concurrency", "2", "--output", str(out))
    deadline = time.monotonic() + START_SECONDS
    while not (partial.exists() and partial.read_text().count("\n") == 2):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.err
        time.sleep(0.05)
    os.kill(site.worker_pid(1, run.proc.pid), signal.SIGKILL)
    code, _ = run.wait(timeout=30)

    assert code == 1, run.err
    assert run.error_line == f"error: rank 1 on {site.hosts[1]}: killed by SIGKILL (exit status -9)"
    assert f"the 2 results that finished are in {partial}" in run.err.replace("\n", "")
    kept = [json.loads(line) for line in partial.read_text().splitlines()]
    assert sorted(r["id"] for r in kept) == [1, 2] and all(r["generation_tokens"] == 4 for r in kept)
    assert out.read_text() == "an earlier run's results\n"


@pytest.mark.ranks
@pytest.mark.parametrize("site", LOCAL_AND_SSH, indirect=True)
def test_rank_exiting_0_early_stops_the_run(site: Site, chat_model: Path) -> None:
    pipe = start_pipeline(site, chat_model, faulty_worker.worker("exit0", on_rank=1, after_tokens=2))
    try:
        tic = time.monotonic()
        with pytest.raises(LaunchError) as e:
            pipe.generate(request_for(STORY, None, STORY_SAMPLING))
        assert time.monotonic() - tic < 30
    finally:
        pipe.stop()
    assert e.value.message == (
        f"rank 1 on {site.hosts[1]}: exited with status 0 before finishing "
        "(mlx.launch would leave the other ranks waiting)"
    )
    assert f"logs: {pipe.run_dir}" in str(e.value.hint)
    assert site.wait_gone(site.rank_pids(os.getpid()), timeout=5) == set()


@pytest.mark.ranks
def test_stuck_rank_is_ended_by_the_watchdog(chat_model: Path, tmp_path: Path) -> None:
    site = Site(tmp_path / "local-2.json", ["127.0.0.1"] * 2)
    site.hostfile.write_text(json.dumps([LOCAL, LOCAL]))
    # 15 s, 10x the gap between a rank's progress reports (1 s and a step): only the hang fires the watchdog.
    pipe = start_pipeline(site, chat_model, faulty_worker.worker("hang", on_rank=1, after_tokens=3), timeout=15)
    try:
        with pytest.raises(LaunchError) as e:
            pipe.generate(request_for(STORY, None, STORY_SAMPLING))
    finally:
        pipe.stop()
    # Both hosts still answer: the watchdog says so, and where each rank stood.
    message = e.value.message
    assert message.startswith("no progress from any rank for 15 s, though every host still answers; last reported: ")
    # Rank 1 (the first stage) last ran the micro-batch that samples token 3, and hung once it was shared.
    assert "rank 1 decode token 3 of request 0 (tick " in message and "rank 0 " in message
    assert "--timeout" in str(e.value.hint)
    assert site.wait_gone(site.rank_pids(os.getpid()), timeout=5) == set()


def start_pipeline(site: Site, model: Path, worker: tuple[str, ...], timeout: float = 60.0) -> Pipeline:
    """A loaded pipeline whose ranks run ``worker``, started as every command starts one."""
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.run import start_pipeline as start

    target = resolve_target(str(model), None, site.hostfile, None, None, None)
    return start(PipelineConfig(target, timeout=timeout, quiet=True, worker=worker))


@pytest.mark.ranks
def test_worker_error_names_rank_host_and_exception(chat_model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank has its own copy of the model; one weight file of rank 1 went missing after the download step.
    hosts = []
    for r in range(2):
        model_dir = tmp_path / f"host{r}"
        copy = model_dir / chat_model.name
        copy.mkdir(parents=True)
        for f in chat_model.iterdir():
            (copy / f.name).symlink_to(f)
        hosts.append({**LOCAL, "model_dir": str(model_dir)})
    index = json.loads((chat_model / "model.safetensors.index.json").read_text())
    # Rank 1 runs the first layers; layer 3's shard holds layers 3-5 only (layer 0's holds the embedding too).
    missing = index["weight_map"]["model.layers.3.self_attn.q_proj.weight"]
    (tmp_path / "host1" / chat_model.name / missing).unlink()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    monkeypatch.setattr("mlxpipe.launch.run.ensure_files", lambda *args, **kwargs: None)

    result = CliRunner().invoke(app, ["generate", "--model", str(chat_model), "--hostfile", str(hostfile),
                                      "--prompt", "Hi", "--max-tokens", "2", "--json"])
    assert result.exit_code == 1, result.output
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    where = re.escape(str(tmp_path / "host1" / chat_model.name))
    assert re.match(rf"error: rank 1 on 127\.0\.0\.1: ModelError: \d+ weights of this rank's layers "
                    rf"are not in {where}: model\.layers\.3\.", line), line
    assert "copy the weight files holding these layers to that directory" in result.stderr
    assert "logs: " in result.stderr and "(rank-1.log)" in result.stderr


# --- Signals to the controller ---------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.parametrize(
    "site, signum",
    [("local", signal.SIGINT), pytest.param("ssh", signal.SIGTERM, marks=pytest.mark.cluster)],
    indirect=["site"], ids=["local-SIGINT", "ssh-SIGTERM"],
)
def test_signal_to_controller_stops_every_rank(site: Site, signum: int, chat_model: Path, controller: Any) -> None:
    run = controller(*generate_args(site, chat_model))
    run.wait_for_text()
    pids = site.rank_pids(run.proc.pid)
    assert len(pids) == 4  # a supervisor and a worker per rank
    run.proc.send_signal(signum)
    code, _ = run.wait(timeout=30)
    assert site.wait_gone(pids, timeout=5) == set()  # gone with the controller: orphans would live on 30 s (lease)
    assert code == 128 + signum
    assert run.error_line == f"error: interrupted by {signal.Signals(signum).name}"


# --- The ssh cluster: preflight and a host that stops answering --------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("fault", ["unreachable", "other-versions"])
def test_preflight_refuses_before_any_rank_starts(cluster: Cluster, fault: str, chat_model: Path,
                                                  other_mlx_python: str) -> None:
    extra = {"python": {1: other_mlx_python}} if fault == "other-versions" else {}
    hostfile = cluster.hostfile(3, model_dir=lambda h: h.dir / "models", **extra)
    if fault == "unreachable":
        cluster.kill_sshd(1)
    result = CliRunner().invoke(app, ["generate", "--model", str(chat_model), "--hostfile", str(hostfile),
                                      "--prompt", "Hi", "--json"])
    assert result.exit_code == 1, result.output
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    check = "ssh: cannot connect" if fault == "unreachable" else f"versions: mlx {OTHER_MLX} here"
    assert line.startswith(f"error: preflight: {cluster.hosts[1]}: {check}"), line
    runs = Path(os.environ["MLXPIPE_HOME"]) / "runs"
    assert not runs.exists() or not list(runs.iterdir())  # no run was started
    assert cluster.leftovers() == {}


@pytest.mark.ranks
@pytest.mark.cluster
@pytest.mark.parametrize("site", [pytest.param("ssh")], indirect=True)
def test_host_that_stops_answering_ends_the_run(site: Site, chat_model: Path, controller: Any) -> None:
    assert site.cluster is not None
    # 15 s: 10x the gap between a rank's progress reports (1 s and a step), so only the blocked host ends the
    # run; at 5 s a loaded machine's first step through the hosts' ssh ended it before any text.
    run = controller(*generate_args(site, chat_model, "--timeout", "15"))
    run.wait_for_text()
    site.cluster.block(1)
    code, _ = run.wait(timeout=60)
    assert code == 1, run.err
    assert run.error_line.startswith(f"error: rank 1 on {site.hosts[1]}: stopped answering: "
                                     "nothing heard from its host for ")
    # Still cut off, the rank stops itself once its lease (--timeout, at least 5 s) runs out.
    assert site.cluster.wait_clean(10) == {}
    site.cluster.heal()
    assert site.cluster.wait_clean(3) == {}
