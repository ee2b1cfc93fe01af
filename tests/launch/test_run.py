"""launch/run.py: what is refused before any rank starts."""

from __future__ import annotations

import pytest

from mlxpipe.errors import ModelError
from tests.e2e.test_draft import models  # noqa: F401,F811 (a fixture)


def test_a_draft_with_another_tokenizer_is_refused_before_launch(models) -> None:
    from mlxpipe.launch.run import check_draft
    from mlxpipe.model.metadata import ModelMetadata

    meta = ModelMetadata(str(models["target"]), {}, (), {}, local=True)
    check_draft(str(models["draft"]), meta)  # the same tokenizer: fine
    with pytest.raises(ModelError, match=r"--draft-model .*other-vocab: its tokenizer has 257 tokens, the model's 256"):
        check_draft(str(models["other_vocab"]), meta)


def test_a_model_whose_caches_cannot_be_trimmed_is_refused_before_launch(models, tiny_models) -> None:
    from mlxpipe.launch.run import check_draft
    from mlxpipe.model.metadata import ModelMetadata

    meta = ModelMetadata(str(tiny_models["lfm2"]), {}, (), {}, local=True)
    with pytest.raises(ModelError, match="^--draft-model: speculative decoding trims rejected drafts from the KV "
                                         "caches, and this model's ArraysCache cannot be trimmed$"):
        check_draft(str(models["draft"]), meta)
