"""Generating: a serving rank's answers to ``generate``, ``batch`` and ``serve``, token by token.

Every rank reads the same messages and runs the same generation, so every
collective lines up; rank 0 samples and reports. The rank loop (``loop``)
sends each request one of two ways: the ``engine``, which overlaps requests
across the stages in lockstep ticks (``schedule``, pure), batches their decode
steps and, on one stage, builds a decode step a tick ahead (``ahead``); or
``streamed``, mlx-lm's own ``stream_generate``, one request at a time (a draft
model, one request on one rank, a model's native ``pipeline()``).

The rooms: ``loop`` (the serving rank's loop, and the one choice between the
two paths), ``engine`` (the overlapped requests), ``schedule`` (which stage
runs what at each tick, and when a request ends), ``hop`` (the hidden state
between the stages), ``ahead`` (the decode step built a tick ahead),
``sampling`` (mlx-lm's samplers and logits processors, a random key per
request), ``constraints`` (a grammar masking a request's logits: structured
output, tool calls), ``tool_grammar`` (a reply's tool calls as a grammar),
``tool_formats`` (how each model's format writes a call), ``lark_writer`` (a
grammar written in the model's own tokens), ``vision_inputs`` (a vision-language model's prompts: image
features, position ids across the cuts), ``reporters`` (what rank 0 tells the
controller) and ``streamed`` (mlx-lm's ``stream_generate``).
"""
