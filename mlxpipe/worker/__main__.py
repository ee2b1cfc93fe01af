"""Entry point of a rank, and the one dispatch of every kind of job to its room.

``python -m mlxpipe.worker --job <base64 JSON>`` serves (``generation.loop``) or, for a training job, trains
(``training.train``); a links job's rank (``mlxpipe doctor --links``): ``python -m mlxpipe.worker --links <ranks>``
(``measure.link_probe``)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from typing import NoReturn

from mlxpipe.protocol import wire
from mlxpipe.protocol.events import Error


def main(argv: list[str] | None = None) -> int:
    """Run one rank until ``exit``; 0 on success, 1 after an ``error`` event."""
    parser = argparse.ArgumentParser(prog="python -m mlxpipe.worker")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--job", help="the JobSpec, as JobSpec.encode() writes it")
    what.add_argument("--links", type=int, metavar="RANKS",
                      help="measure the job's hosts and links (worker.measure.link_probe)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("MLX_RANK", "-1"))
    try:
        # Imported here so that an import failure is reported as an event too.
        from mlxpipe.protocol.job import JobSpec

        if args.links is not None:
            from mlxpipe.worker.measure.link_probe import main as links

            links(args.links)
            return 0
        if JobSpec.decode(args.job).train is not None:
            from mlxpipe.worker.training.train import run
        else:
            from mlxpipe.worker.generation.loop import run
        run(args.job)
        return 0
    except Exception as e:  # noqa: BLE001 - every failure must reach the controller
        wire.emit(Error(
            rank=rank,
            host=socket.gethostname(),
            type=type(e).__name__,
            message=str(e),
            hint=getattr(e, "hint", None),
            traceback=traceback.format_exc(),
            time=time.time(),
        ))
        return 1


def leave(code: int) -> NoReturn:
    """Exit now, output flushed, without Python's teardown of mlx, mlx-lm and transformers: 0.4 s of a core
    per rank at the end of every run, for nothing. The rank has said bye or reported its error by then, and
    nothing is left to write (the prompt caches' writer finishes before bye)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    wire.start_beating()  # to the supervisor, which stops a worker that falls silent (launch/supervisor.py)
    leave(main())
