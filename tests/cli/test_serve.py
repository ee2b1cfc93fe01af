"""``mlxpipe serve``: flags refused before any rank starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mlxpipe.cli import app
from mlxpipe.cli.serve import image_limits
from mlxpipe.vision.images import ImageLimits


def test_serve_refuses_concurrency_with_a_draft_model(models) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(models["target"]), "--draft-model",
                                      str(models["draft"]), "--max-concurrency", "4"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[0] == (
        "error: --max-concurrency: with --draft-model requests run one at a time (speculative decoding is not "
        "batched, as in mlx_lm.server)"), result.output


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--max-image-mb", "0", "error: --max-image-mb must be positive, got 0"),
    ("--max-image-pixels", "-1", "error: --max-image-pixels must be positive, got -1"),
    ("--max-images", "0", "error: --max-images must be at least 1, got 0"),
])
def test_serve_refuses_a_bad_image_limit_in_one_line(flag: str, value: str, line: str) -> None:
    result = CliRunner().invoke(app, ["serve", flag, value])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [line], result.output


def test_image_limit_flags_become_the_servers_limits() -> None:
    assert image_limits(20, 50, 8) == ImageLimits()  # the defaults --help shows are today's constants
    assert image_limits(0.5, 1.5, 2) == ImageLimits(max_bytes=512 * 1024, max_pixels=1_500_000, max_images=2)


def test_the_resume_and_prefill_flags_become_the_queues_options() -> None:
    from mlxpipe.cli.serve import ServeFlags
    from mlxpipe.defaults import DEFAULT_PREFILL_BUDGET, DEFAULT_RESUME_TIMEOUT
    from mlxpipe.protocol.messages import Serve

    given = ServeFlags(max_concurrency=2, resume_timeout=30, prefill_budget=16).options(None)  # type: ignore[arg-type]
    assert (given.resume_timeout, given.prefill_budget) == (30, 16)
    default = ServeFlags(max_concurrency=2).options(None)  # type: ignore[arg-type]
    assert (default.resume_timeout, default.prefill_budget) == (DEFAULT_RESUME_TIMEOUT, DEFAULT_PREFILL_BUDGET)
    # What the ranks read: the budget, or none.
    assert Serve.from_wire(Serve(concurrency=2, prefill_budget=16).to_wire()).prefill_budget == 16
    with pytest.raises(Exception, match="prefill_budget"):
        Serve(concurrency=2, prefill_budget=0)
