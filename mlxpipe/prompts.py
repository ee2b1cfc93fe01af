"""A request's prompt as token ids: the chat template, the system prompt, the BOS rule.

One function for the ranks (``generate``, ``--prompts-file``) and for the
server's controller (``serve`` tokenizes before anything reaches a rank), so a
prompt becomes the same tokens wherever it is turned into them, and the same as
``mlx_lm.generate`` makes of it (``--system-prompt``, ``--prefill-response``,
``--chat-template-config``, ``--use-default-chat-template``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxpipe.errors import UsageError
from mlxpipe.protocol.request import Request

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def prompt_tokens(tokenizer: TokenizerWrapper, request: Request, tools: list[Any] | None = None) -> list[int]:
    """The request's prompt (``tokens``, ``prompt`` or ``messages``) as token ids, through the chat template if any."""
    if request.tokens is not None:
        return list(request.tokens)
    prompt, messages = request.prompt, request.messages
    if (prompt is None) == (messages is None):
        raise UsageError("a generate request needs exactly one of prompt and messages")
    if request.use_default_chat_template and tokenizer.chat_template is None:
        # As mlx_lm.server; transformers 4.44 and later have no default template, and nothing changes.
        default = getattr(tokenizer, "default_chat_template", None)
        if default is not None:
            tokenizer.chat_template = default
    use_template = not request.ignore_chat_template and tokenizer.has_chat_template
    if messages is None and not use_template:
        assert prompt is not None  # exactly one of the two, checked above
        # As stream_generate: no second BOS when the prompt brings one.
        bos = tokenizer.bos_token
        add_bos = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_bos))
    if not use_template:
        raise UsageError("chat messages need a tokenizer with a chat template")
    messages = list(messages) if messages is not None else [{"role": "user", "content": prompt}]
    if request.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": request.system_prompt})
    prefill = request.prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": request.prefill_response})
    extra: dict[str, Any] = dict(request.chat_template_config or {})
    if tools:
        extra["tools"] = tools
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))
