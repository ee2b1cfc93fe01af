"""The vision families' table: what the controller refuses before launch, the installed mlx-vlm's sources agreeing
with it, and docs/architectures.md generated from it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.vision_models import FAMILIES
from mlxpipe.errors import ModelError, UsageError
from mlxpipe.vision import families


def _mlx_vlm_models() -> Path:
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mlx-vlm is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def test_docs_table_is_generated_from_the_code() -> None:
    section = families.table_section(families.DOC.read_text())
    assert section == families.table(), "run: python -m mlxpipe.vision.families"


def test_the_families_that_run_are_the_ones_the_e2e_tests_check() -> None:
    assert set(families.RUNS) == set(FAMILIES)
    assert not set(families.RUNS) & set(families.refused())
    # A family that runs reads from the vision tower only what its first stage's layers read (deepstack).
    for model_type in families.RUNS:
        assert set(families.READS.get(model_type, ())) <= set(families.DEEPSTACK_FEATURES), model_type
        assert (model_type in families.READS) == (model_type in families.DEEPSTACK), model_type


def test_a_split_without_the_deepstack_layers_on_the_first_stage_is_refused() -> None:
    """Qwen3-VL adds deepstack features after its first k layers: the first stage (the split's last entry) must
    hold them and the layer after them (its last layer hands its output on before the features are added); one
    line naming the model type, k and the flag."""
    config = {"model_type": "qwen3_vl", "vision_config": {"deepstack_visual_indexes": [5, 11, 17]}}
    assert families.deepstack_layers(config) == 3
    families.check_deepstack(config, [30, 4])
    families.check_deepstack(config, [3])  # one stage: nothing is handed on
    with pytest.raises(UsageError) as caught:
        families.check_deepstack(config, [31, 3])
    assert caught.value.message == (
        "qwen3_vl: its language model adds the vision tower's deepstack features after layers 0-2, which must run "
        "on the first stage (the highest rank) with the layer after them: it needs 4 layers, the split gives it 3")
    assert caught.value.hint == "give the last --split entry at least 4 layers"
    families.check_deepstack({"model_type": "qwen2_5_vl", "vision_config": {}}, [3, 1])  # no deepstack: any split


def test_refusals_match_the_installed_mlx_vlm() -> None:
    """Every vision family whose language model names a feature the pipeline does not carry is refused for it,
    as the ranks' load-time check (``worker.vision.unsupported_features``) would find."""
    models = _mlx_vlm_models()
    found = {}
    for language in sorted(models.glob("*/language.py")):
        folder = language.parent
        if not any("vision_config" in p.read_text() or "VisionConfig" in p.read_text() for p in folder.glob("*.py")):
            continue
        source = language.read_text()
        reads = tuple(f for f in families.FEATURE_REASONS if f in source)
        if reads:
            found[folder.name] = reads
    assert {t: set(r) for t, r in found.items()} == {t: set(r) for t, r in families.READS.items()}
    for model_type in [*families.RUNS, *families.REFUSED_OTHERWISE]:
        assert (models / model_type).is_dir(), f"{model_type} is no mlx-vlm model type"


def test_a_refused_family_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(ModelError) as caught:
        families.check_family({"model_type": "qwen3_omni_moe", "vision_config": {}})
    message = caught.value.message
    assert message.startswith("qwen3_omni_moe: mlxpipe cannot split this vision-language model: its language "
                              "model reads")
    assert "deepstack_visual_embeds" in message and "\n" not in message
    with pytest.raises(ModelError, match=r"^llava: .*mlx-vlm 0\.7\.10 cannot run it either"):
        families.check_family({"model_type": "llava", "vision_config": {}})
    for model_type in [*families.RUNS, "pixtral", "some_future_vlm"]:
        families.check_family({"model_type": model_type, "vision_config": {}})
    assert families.status("gemma3") == "runs"
    assert families.status("mllama") == "refused"
    assert families.status("idefics3") == "untested"


def test_a_family_the_sharder_cannot_split_is_refused_with_tp() -> None:
    """One line naming --tp, the model type and what the sharder cannot split; the pipeline alone runs it."""
    config = {"model_type": "llama4", "vision_config": {}}
    families.check_tensor_parallel(config, 1)
    with pytest.raises(UsageError) as caught:
        families.check_tensor_parallel(config, 2)
    assert caught.value.message == ("--tp 2: llama4: the tensor-parallel sharder cannot split mlx-vlm's model: its "
                                    "experts' router (feed_forward.router)")
    families.check_tensor_parallel({"model_type": "qwen3_vl", "vision_config": {}}, 2)
    assert set(families.NO_TENSOR_PARALLEL) <= set(families.RUNS)


def test_model_types_are_remapped_as_mlx_vlm_remaps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _mlx_vlm_models()
    assert families.family_type({"model_type": "cohere2_vision"}) == "aya_vision"
    assert families.family_type({"model_type": "Gemma3"}) == "gemma3"


def test_importing_the_table_imports_neither_mlx_nor_mlx_vlm() -> None:
    probe = (
        "import json, sys\n"
        "from mlxpipe.vision import families\n"
        "families.check_family({'model_type': 'gemma3'})\n"
        "families.family_type({'model_type': 'cohere2_vision'})\n"
        "sys.stderr.write(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_vlm'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stderr) == []
