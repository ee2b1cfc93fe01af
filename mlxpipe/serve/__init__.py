"""``mlxpipe serve``: the pipeline kept up behind an HTTP API.

``server`` runs it (uvicorn), ``controller`` keeps the pipeline (launch, requests, restarts), ``app`` is the
HTTP API, ``text`` turns tokens into what a client sees."""
