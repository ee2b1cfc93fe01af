"""``mlxpipe serve``: flags refused before any rank starts."""

from __future__ import annotations

from typer.testing import CliRunner

from mlxpipe.cli import app
from tests.e2e.test_draft import models  # noqa: F401 (a fixture)


def test_serve_refuses_concurrency_with_a_draft_model(models) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(models["target"]), "--draft-model",
                                      str(models["draft"]), "--max-concurrency", "4"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[0] == (
        "error: --max-concurrency: with --draft-model requests run one at a time (speculative decoding is not "
        "batched, as in mlx_lm.server)"), result.output
