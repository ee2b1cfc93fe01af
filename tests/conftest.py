"""Shared pytest set-up: every test runs with its own HOME and Hugging Face cache, seeded; mlxpipe's own files
(run logs, the prompt cache on disk) go to a temp dir even from session fixtures.

Fixtures live in ``tests/fixtures/``, those that build expensive things (models, the fake hub, the test
cluster) session-scoped; the ones tests share are imported here. Sampling is seeded by
default (``fixtures/seeding.py``): MLX's random state before each test, and a seed in every sampled
request to a local server that names none.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# From tests/fixtures/, below this line: MLX's compilation off for the whole suite, the tiers' plugin, and every
# fixture tests share (a test names one as a parameter and never imports it).
from fixtures import mlx_compile, tiers
from fixtures.agents import agent_clis, agent_model, recording_proxy  # noqa: F401
from fixtures.arch_launches import arch_root, arch_runs  # noqa: F401
from fixtures.browser import browser  # noqa: F401
from fixtures.cli import jobs_not_started  # noqa: F401
from fixtures.cluster import cluster, cluster_session  # noqa: F401
from fixtures.demo_model import chat_model, demo_model  # noqa: F401
from fixtures.doctor import other_mlx_python  # noqa: F401
from fixtures.draft_models import models  # noqa: F401
from fixtures.fake_hub import fake_hub, hub_env  # noqa: F401
from fixtures.generation_options import option_model  # noqa: F401
from fixtures.hostfiles import four_macs  # noqa: F401
from fixtures.lora_workdir import workdir  # noqa: F401
from fixtures.seeding import mlx_seed, mlx_seed_module, mlx_seed_session, seeded_requests  # noqa: F401
from fixtures.serve_process import server  # noqa: F401
from fixtures.tiny_models import tiny_models, tp_llama  # noqa: F401
from fixtures.tool_model import tool_model  # noqa: F401
from fixtures.vision_models import vision_models  # noqa: F401

mlx_compile.disable()  # before anything compiles: fixtures/mlx_compile.py says why

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs sessions of its own


def pytest_addoption(parser: pytest.Parser) -> None:
    tiers.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    """The markers kept true: a test that starts ranks or builds the cluster without its marker fails
    (``fixtures/tiers.py``)."""
    tiers.register(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    tiers.unregister(config)


@pytest.fixture(scope="session", autouse=True)
def isolated_mlxpipe_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point MLXPIPE_HOME at a temp dir for the whole session: session and module fixtures start before
    ``isolated_home``, and mlxpipe's own files (run logs, the prompt cache's disk tier) never land in ~/.cache."""
    home = tmp_path_factory.mktemp("mlxpipe-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXPIPE_HOME", str(home))
        yield home


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point HOME, HF_HOME and MLXPIPE_HOME at a fresh temp dir for each test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("MLXPIPE_HOME", str(home / ".cache" / "mlxpipe"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return home
