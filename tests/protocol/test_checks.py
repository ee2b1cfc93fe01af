"""protocol/checks.py: one check per value, named the way its caller spells it."""

from __future__ import annotations

import pytest

from mlxpipe.errors import UsageError
from mlxpipe.protocol.checks import at_least, check_mode, one_of, positive


def test_a_value_in_range_comes_back_as_given() -> None:
    assert at_least(3, 1, "--decode-batch") == 3
    assert positive(0.5, "--timeout") == 0.5
    assert one_of("dora", ("lora", "dora"), "fine_tune_type") == "dora"
    assert check_mode("native", "--pipeline") == "native"


@pytest.mark.parametrize("check, error", [
    (lambda: at_least(0, 1, "--decode-batch"), "--decode-batch must be at least 1, got 0"),
    (lambda: at_least(0, 1, "decode_batch"), "decode_batch must be at least 1, got 0"),
    (lambda: positive(0, "--prefill-step-size"), "--prefill-step-size must be positive, got 0"),
    (lambda: positive(-1.5, "--timeout"), "--timeout must be positive, got -1.5"),
    (lambda: check_mode("magic", "--pipeline"), "--pipeline 'magic': use one of generic, native"),
])
def test_a_value_out_of_range_is_refused_by_the_name_given(check, error: str) -> None:
    with pytest.raises(UsageError) as info:
        check()
    assert info.value.message == error
