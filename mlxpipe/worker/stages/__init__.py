"""The model cut into stages: pipeline parallelism for any mlx-lm text model that keeps its blocks in a list.

mlx-lm pipelines a model only when the architecture's own ``__call__`` was
written for it (``PipelineMixin``). The generic wrapper here leaves the model
code untouched and changes only the entries of its ``layers`` list, with
mlx-lm's convention: rank 0 runs the last layers, the highest rank the first.

* Layers held by other ranks become *stand-ins*: the same objects with their
  weights removed and their class swapped for a subclass whose ``__call__``
  passes the hidden state through. Model code still reads their attributes
  (``use_sliding``, ``self_attn.is_local``, ``isinstance`` checks) unchanged.
  A stand-in feeds its cache zero-width keys and values, so the cache's own
  code advances its offset and rotation exactly as for the real layer: masks
  built from ``cache[0]`` or any other layer's cache stay right on every rank.
  mlx-lm's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``) advance
  the same way, per-request offsets and left padding included, and merge,
  filter and extend like the real layers' (zero-width rows).
* The first local layer receives the hidden state from rank + 1; the last
  local layer sends it to rank - 1 and ties the send into its cache, because
  mlx-lm's prefill evaluates only the caches.
* After the model's last layer every rank all-gathers the hidden state and
  keeps rank 0's part, so every rank computes the same logits and samples the
  same token.
* A block may return more than the hidden state (``(h, v_first)``): the extra
  arrays shaped like the state's batch and tokens cross the cut packed with it,
  and the stand-ins before the first local layer return zeros of their shapes,
  replaced by the received ones where the model passes them on
  (``learn_layouts`` finds out at load what crosses each cut).

Overlapped requests (``mlxpipe.worker.generation.engine``) move hidden states
themselves, between micro-batches of different requests: with the rank's
``Exchange`` made explicit, the first local layer takes ``hidden_in``, the last
one leaves its output in ``hidden_out``, and nothing is sent or gathered.

The rooms: ``layers`` (finding a model's blocks, what cannot be cut),
``stage`` (the wrapper around each block, the hand-over at the cut),
``layout`` (what crosses a cut besides the hidden state, packed as bytes),
``caches`` (stand-ins' caches kept in step, the send tied into them) and
``cut`` (cutting a model: ``pipeline_generic``, ``pipeline_native``, and
``learn_layouts`` at load).
"""
