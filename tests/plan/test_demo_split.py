"""The default split of the demo model on two local ranks, from its real checkpoint (no rank started).

Moved out of ``e2e/test_serve_openai.py``, whose shared server now serves the chat model: the server's
``/health`` is checked there against the plan of the model it serves, the demo's own split here.
"""

from __future__ import annotations

from pathlib import Path

from mlxpipe.cluster.hostfile import load_hostfile
from mlxpipe.model.metadata import load_local
from mlxpipe.plan.shard import make_plan

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_models_default_split_weighs_the_head_once_per_generated_token(demo_model: Path) -> None:
    the_plan = make_plan(load_local(demo_model), load_hostfile(REPO / "hostfiles/local-2.json").hosts)
    # The default split weighs both phases of a chat turn: rank 0's vocabulary head (worth 13 layers here) works
    # once per generated token, the layers once per prompt token too (issue 31; it was (8, 22) when the head was
    # weighed on every token).
    assert the_plan.split == (15, 15)
