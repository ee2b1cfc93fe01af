"""A request's prompt as token ids: the chat template, the system prompt, the BOS rule.

One function for the ranks (``generate``, ``--prompts-file``) and for the
server's controller (``serve`` tokenizes before anything reaches a rank), so a
prompt becomes the same tokens wherever it is turned into them, and the same as
``mlx_lm.generate`` makes of it.
"""

from __future__ import annotations

from typing import Any

from mlxpipe.errors import UsageError


def prompt_tokens(tokenizer: Any, request: dict[str, Any], tools: list[Any] | None = None) -> list[int]:
    """The request's prompt (``prompt`` or ``messages``) as token ids, through the chat template if any."""
    prompt, messages = request.get("prompt"), request.get("messages")
    if (prompt is None) == (messages is None):
        raise UsageError("a generate request needs exactly one of prompt and messages")
    use_template = not request.get("ignore_chat_template") and tokenizer.has_chat_template
    if messages is None and not use_template:
        # As stream_generate: no second BOS when the prompt brings one.
        bos = tokenizer.bos_token
        add_bos = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_bos))
    if not use_template:
        raise UsageError("chat messages need a tokenizer with a chat template")
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    messages = list(messages)
    system = request.get("system_prompt")
    if system is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system})
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))
