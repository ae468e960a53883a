"""``python -m service`` (``hydra-serve``): the command line, its settings validated, then one server or a
supervisor of several (:mod:`service.entrypoints`, whose docstring gives the start-up and the exit statuses).
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from service.entrypoints.http_server import http_stack
from service.entrypoints.serving import (
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
    from service.entrypoints.workers import resolve_workers, supervise

    n = resolve_workers(settings.workers, settings.device)
    if n > 1:
        from service.logs import configure_logging

        configure_logging(settings)
        return supervise(n, settings.host, settings.port, args.graceful_timeout)
    return serve(args.graceful_timeout, settings)


if __name__ == "__main__":
    sys.exit(main())
