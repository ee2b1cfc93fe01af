"""prompts.py: a request's prompt as the token ids mlx_lm.generate makes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxpipe.prompts import prompt_tokens
from mlxpipe.protocol.request import Request

# ---------------------------------------------------------------- prompts, as mlx_lm.generate makes them


def _template_tokenizer(path: Path) -> Any:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}{% if shout %}!{% endif %}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    return tokenizer


def test_template_options_make_the_prompt_mlx_lm_generate_makes(tiny_models) -> None:
    tokenizer = _template_tokenizer(tiny_models["llama"])
    request = Request(prompt="Hi", system_prompt="Be kind.", prefill_response="Sure,",
                      chat_template_config={"shout": True})
    # mlx_lm.generate's main(), for the same flags.
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Sure,"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                         add_generation_prompt=False, shout=True)
    assert text.startswith("[system!]Be kind.[user!]Hi[assistant!]Sure,")
    assert prompt_tokens(tokenizer, request) == tokenizer.encode(text, add_special_tokens=False)


def test_use_default_chat_template_changes_nothing_where_transformers_has_no_default(tiny_models) -> None:
    tokenizer = _template_tokenizer(tiny_models["llama"])
    plain = Request(prompt="Hi")
    assert prompt_tokens(tokenizer, replace(plain, use_default_chat_template=True)) == prompt_tokens(tokenizer, plain)
