"""plan/parallel_layout.py: a layout's name and flags, what cannot be a layout, the workloads by name."""

from __future__ import annotations

import pytest

from mlxpipe.errors import UsageError
from mlxpipe.plan.parallel_layout import AGENT, BATCH, CHAT, Layout, Workload, workload


@pytest.mark.parametrize(("layout", "name", "flags"), [
    (Layout(1, (16,), "even", 1), "1 host", ""),
    (Layout(1, (6, 6), "balanced", 2), "pipeline balanced 6,6", "--split 6,6"),
    (Layout(2, (12,), "even", 2), "tp 2", "--tp 2"),
    (Layout(2, (5, 7), "even", 4), "tp 2 x 2 stages even 5,7", "--tp 2 --split 5,7"),
])
def test_a_layout_says_its_name_and_the_flags_that_run_it(layout: Layout, name: str, flags: str) -> None:
    assert (layout.name, layout.flags) == (name, flags)


@pytest.mark.parametrize(("tp", "split", "hosts"), [(2, (6, 6), 2), (3, (12,), 4), (1, (6, 6), 3), (0, (12,), 1)])
def test_a_split_that_does_not_match_the_groups_is_no_layout(tp: int, split: tuple[int, ...], hosts: int) -> None:
    with pytest.raises(ValueError):
        Layout(tp, split, "even", hosts)


def test_workloads_by_name() -> None:
    assert [workload(n) for n in (None, "chat", "agent", "batch")] == [CHAT, CHAT, AGENT, BATCH]
    with pytest.raises(UsageError) as info:
        workload("chatty")
    assert info.value.message == "--workload 'chatty': use one of chat, agent, batch"
    assert CHAT.describes == "a chat turn (1,000-token prompt, 250 tokens out)"
    assert Workload.concurrency(3) == 12  # a decode group of the default size per stage of the longest pipeline
