"""What the benchmarks share: core placement and pinning, pinned runs, tiny qwen2 checkpoints.

Every ``bench/bench_*.py`` imports from here (``python bench/<script>.py`` puts ``bench/``
on ``sys.path``), never from another benchmark.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the tiny-checkpoint builder lives with the test fixtures

from fixtures.pinning import cores, pin_workers, rank_cores  # noqa: E402 - after the path above
from fixtures.pinning import pin as pin  # noqa: E402 - ``as pin``: the benchmarks take it from here

QWEN2_BENCH = {
    "hidden_size": 768, "intermediate_size": 1024, "num_attention_heads": 12,
    "num_key_value_heads": 2, "head_dim": 64,
}
QWEN2_LAYERS = 20


# --- placement ------------------------------------------------------------------------


def placement(ranks: int) -> str:
    """How ``ranks`` workers were placed, for the table."""
    if ranks == 0:
        return f"core {cores()[0]}"
    chosen = rank_cores(ranks)
    text = ", ".join(f"r{r}->c{c}" for r, c in enumerate(chosen))
    return text + (" (shared)" if len(set(chosen)) < ranks else "")



# --- pinned runs ----------------------------------------------------------------------


def run_pinned(script: str, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """``script`` run with ``args`` in a subprocess pinned to the first core (``taskset``), from the repo."""
    argv = ["taskset", "-c", str(cores()[0]), sys.executable, script, *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, cwd=REPO)


@contextlib.contextmanager
def pinned_pipeline(model: Path, ranks: int, **config: Any) -> Iterator[Any]:
    """A loaded pipeline of ``ranks`` local ranks started as the CLI starts one (``running_pipeline``),
    each worker pinned to a core of its own; ``config``: more ``PipelineConfig`` fields."""
    from mlxpipe.cluster.target import resolve_target
    from mlxpipe.launch.config import PipelineConfig
    from mlxpipe.launch.run import running_pipeline

    strategy = config.pop("strategy", None)
    target = resolve_target(str(model), None, REPO / "hostfiles" / f"local-{ranks}.json", strategy, None, None)
    with running_pipeline(PipelineConfig(target=target, quiet=True, **config)) as pipe:
        pin_workers(pipe.job.encode(), ranks)
        yield pipe


# --- checkpoints and the machine ------------------------------------------------------


def build_qwen2(dest: Path, layers: int = QWEN2_LAYERS, overrides: dict[str, int] = QWEN2_BENCH,
                shards: int = 10) -> Path:
    """A random float32 qwen2 of ``layers`` layers in ``dest`` (``overrides``: config keys)."""
    from fixtures.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen2", dest, num_layers=layers, num_shards=shards, overrides=overrides)


def cpu_name() -> str:
    """The CPU's model name, for the notes under a table."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
