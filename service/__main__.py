"""``python -m service``: serve ``HYDRA_ARTIFACTS`` on ``HYDRA_HOST:HYDRA_PORT`` (default 127.0.0.1:8000).

Start-up: the artifacts are verified before the port is bound, then loaded and
warmed up in the background (``/healthz`` 200, ``/readyz`` 503 meanwhile); once
ready, what start-up allocated is frozen out of the garbage collector's scans
(:func:`freeze_startup_heap`).
uvicorn runs on uvloop and httptools when they import (``HYDRA_LOOP``, ``HYDRA_HTTP``;
:mod:`service.server`). On SIGTERM / SIGINT the server refuses new connections,
answers those the kernel had already queued, closes the listening socket, lets
in-flight requests finish (up to ``--graceful-timeout`` seconds), then the app's
lifespan drains the batch queues and stops the model workers, and the process
exits 0 (:class:`service.server.Server` explains how nothing is reset).

With ``HYDRA_WORKERS`` above 1 this process supervises that many server processes on one
port (:mod:`service.workers`); each runs :func:`service.serving.serve`.

Exit status: 0 stopped by a signal after a graceful shutdown; 1 forced stop (a
second SIGINT); 2 invalid settings; 3 refused to
start (the log names the bad artifact file or setting); 4 loading or warming up
a model failed after start-up (the log says why; restart after fixing it).
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from service.server import http_stack
from service.serving import (
    EXIT_FORCED,
    EXIT_LOAD_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SETTINGS,
    freeze_startup_heap,
    serve,
)
from service.settings import Settings, settings_errors

__all__ = ["main", "freeze_startup_heap", "EXIT_OK", "EXIT_FORCED", "EXIT_SETTINGS", "EXIT_REFUSED", "EXIT_LOAD_FAILED"]


def main(argv: list[str] | None = None) -> int:
    """Validate the settings, then serve until a signal stops the server; the exit status is 0 on a clean stop."""
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__.splitlines()[0])
    p.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    args = p.parse_args(argv)

    try:
        settings = Settings()
        http_stack(settings.loop, settings.http)
    except (ValidationError, ValueError) as e:
        lines = settings_errors(e) if isinstance(e, ValidationError) else [str(e)]
        print("\n".join(f"invalid HYDRA_* settings: {line}" for line in lines), file=sys.stderr)
        return EXIT_SETTINGS
    from service.workers import resolve_workers, supervise

    n = resolve_workers(settings.workers, settings.device)
    if n > 1:
        from service.logs import configure_logging

        configure_logging(settings)
        return supervise(n, settings.host, settings.port, args.graceful_timeout)
    return serve(args.graceful_timeout, settings)


if __name__ == "__main__":
    sys.exit(main())
