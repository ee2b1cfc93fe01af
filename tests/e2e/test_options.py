"""mlx_lm.generate's options: exact tokens on real ranks.

Every option must give, on 2 ranks, exactly the tokens single-process mlx-lm gives with that
option (greedy, or seeded sampling for the sampler's options): overlapped through the engine
(``--prompts-file``, ``serve``), alone through it (``generate``, ``chat``), and through mlx-lm's
``stream_generate`` (``--pipeline native``). One ``mlx.launch`` run serves every option
(``fixtures/option_ranks.py``). The serve bodies' names are checked against a real server in
``test_serve_openai.py``; the flags and prompts-file lines down to the wire below (no ranks).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from fixtures.generation_options import OPTIONS, SPLIT
from fixtures.generation_options import chat_request as _chat
from fixtures.generation_options import raw_request as _raw
from fixtures.option_reference import reference as mlx_lm_reference
from fixtures.ranks import launch_cases, rank_dirs
from mlxpipe.protocol.job import JobSpec

PREFILL_STEP = 8
_TIMEOUT = 420.0


ADAPTER_REQUESTS: dict[str, dict[str, Any]] = {"adapter_chat": _chat(), "adapter_raw": _raw()}
# Options that need not change the tokens of this tiny model (they are exercised all the same).
UNCHANGED = {"chat_template_config"}


# ---------------------------------------------------------------- every option on real ranks


def reference(path: Path, fields: dict[str, Any], adapters: Path | None = None) -> list[int]:
    return mlx_lm_reference(path, fields, adapters, prefill_step_size=PREFILL_STEP)[0]


def _without(fields: dict[str, Any]) -> dict[str, Any]:
    """The same request with mlxpipe's defaults for every option but the prompt, length, temperature and seed."""
    keep = {"messages", "prompt", "ignore_chat_template", "max_tokens", "temp", "seed"}
    return {k: v for k, v in fields.items() if k in keep}


def _requests(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """``OPTIONS`` with the extra EOS made one the greedy reply meets (its third token), and the logit
    bias banning its first."""
    requests = {key: {"id": key, **fields} for key, fields in OPTIONS.items()}
    third = reference(checkpoint, _without(OPTIONS["extra_eos"]))[2]
    requests["extra_eos"]["extra_eos_token"] = ["<|endoftext|>", str(third)]
    first = reference(checkpoint, _without(OPTIONS["logit_bias"]))[0]
    requests["logit_bias"]["logit_bias"] = {first: -100.0, 116: 2.0}
    return requests


@pytest.fixture(scope="module")
def option_runs(option_model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checkpoint, adapters = option_model
    tmp = tmp_path_factory.mktemp("option-runs")
    dirs = [str(d) for d in rank_dirs(checkpoint, SPLIT, tmp / "dirs")]
    requests = list(_requests(checkpoint).values())
    cases = [
        {"id": "options", "job": asdict(JobSpec(dirs, SPLIT, prefill_step_size=PREFILL_STEP)),
         "requests": requests, "concurrency": 3},
        {"id": "native", "job": asdict(JobSpec(dirs, SPLIT, mode="native", prefill_step_size=PREFILL_STEP)),
         "requests": requests},
        {"id": "adapters", "job": asdict(JobSpec(dirs, SPLIT, prefill_step_size=PREFILL_STEP,
                                                 adapter_path=str(adapters))),
         "requests": [{"id": key, **fields} for key, fields in ADAPTER_REQUESTS.items()], "concurrency": 2},
    ]
    result = launch_cases("option_ranks.py", cases, 2, tmp, timeout=_TIMEOUT)
    by_case = {(e["id"], e["rank"]): e for e in result.of("options_case")}
    if len(by_case) != 2 * len(cases):
        pytest.fail(f"not every case came back from every rank\n{result.describe()}")
    return {"cases": {c["id"]: c for c in cases}, "events": by_case}


@pytest.mark.ranks
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_is_token_identical_to_mlx_lm(option_runs, option_model, option: str) -> None:
    checkpoint, _ = option_model
    request = next(r for r in option_runs["cases"]["options"]["requests"] if r["id"] == option)
    fields = {k: v for k, v in request.items() if k != "id"}
    expected = reference(checkpoint, fields)
    event = option_runs["events"][("options", 0)]
    assert event["engine"][option]["tokens"] == expected, "overlapped (--prompts-file, serve)"
    assert event["alone"][option]["tokens"] == expected, "alone (generate, chat)"
    assert option_runs["events"][("native", 0)]["alone"][option]["tokens"] == expected, "stream_generate (native)"
    if option not in UNCHANGED:
        assert expected != reference(checkpoint, _without(fields)), "the option changes nothing: a weak test"
    if option == "extra_eos":
        assert len(expected) <= 3


@pytest.mark.ranks
@pytest.mark.parametrize("request_id", list(ADAPTER_REQUESTS))
def test_adapters_give_mlx_lms_tokens(option_runs, option_model, request_id: str) -> None:
    checkpoint, adapters = option_model
    fields = ADAPTER_REQUESTS[request_id]
    expected = reference(checkpoint, fields, adapters)
    event = option_runs["events"][("adapters", 0)]
    assert event["engine"][request_id]["tokens"] == expected
    assert event["alone"][request_id]["tokens"] == expected
    assert expected != reference(checkpoint, fields), "the adapters change nothing: a weak test"


# ---------------------------------------------------------------- the command line, end to end


def test_flags_and_prompts_file_lines_reach_the_ranks(option_model: tuple[Path, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate --prompts-file`` with option flags (the lines' defaults) and a line overriding them, adapters on:
    the JobSpec the ranks decode names the adapters, and each request on the wire is its line over the flags (what
    each option then does on the ranks is checked token for token above; the command runs end to end in
    ``test_overlap.py``)."""
    from typer.testing import CliRunner

    from mlxpipe.cli import app
    from mlxpipe.errors import LaunchError
    from mlxpipe.launch.pipeline import Pipeline
    from mlxpipe.protocol.messages import Batch
    from mlxpipe.protocol.request import Request

    checkpoint, adapters = option_model
    sent: dict[str, Any] = {}

    def start(self: Pipeline, on_loaded: Any = None) -> None:
        sent["job"] = JobSpec.decode(self.job.encode())  # what the ranks read from their command line

    def generate_batch(self: Pipeline, requests: Any, *args: Any, **kwargs: Any) -> None:
        wire = Batch.from_wire({"type": "batch", "requests": [r.to_wire() for r in requests], "concurrency": 1})
        sent["requests"] = Batch.from_wire(json.loads(json.dumps(wire.to_wire()))).requests
        raise LaunchError("not starting ranks in this test")

    monkeypatch.setattr(Pipeline, "start", start)
    monkeypatch.setattr(Pipeline, "generate_batch", generate_batch)
    monkeypatch.setattr(Pipeline, "stop", lambda self: None)
    flags = {"temp": 1.0, "top_k": 2, "seed": 4, "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 10}
    lines = [_raw(max_tokens=6), _chat(max_tokens=6, temp=0.0, top_k=0, prefill_response="Sure")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    hostfile = tmp_path / "local-2.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    args = ["generate", "--model", str(checkpoint), "--hostfile", str(hostfile), "--prompts-file", str(path),
            "--adapter-path", str(adapters), "--json", "--prefill-step-size", str(PREFILL_STEP)]
    for key, value in flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "not starting ranks" in result.stderr, result.output
    job = sent["job"]
    assert (job.adapter_path, job.prefill_step_size) == (str(adapters), PREFILL_STEP)
    got = [Request.from_wire(r) if isinstance(r, dict) else r for r in sent["requests"]]
    expected = [Request.from_wire({**flags, **line, "id": i}) for i, line in enumerate(lines, 1)]
    assert [r.to_wire() for r in got] == [r.to_wire() for r in expected]
    assert got[0].temp == 1.0 and got[1].temp == 0.0  # a line's own value wins over the flag
