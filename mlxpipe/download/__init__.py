"""``mlxpipe download``: the controller side (per-host tasks, progress) and the host side (``fetch``)."""
