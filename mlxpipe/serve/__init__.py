"""``mlxpipe serve``: the pipeline kept up behind an HTTP API.

``server`` runs it (uvicorn), ``queue`` keeps the pipeline up and carries every request to the ranks and back
(launch, requests, restarts), ``app`` is the HTTP app: one module per API door (``openai_api``, with its bodies
in ``openai_schemas`` and its shapes in ``openai_shapes``) over what every door shares (``door``: key, body
limit, admission, errors; ``bodies``: body checks; ``generation``: one request's reply, streamed or whole, and
its log line), and ``text`` turns tokens into what a client sees."""
