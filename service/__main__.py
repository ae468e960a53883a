"""``python -m service``: serve ``HYDRA_ARTIFACTS`` on ``HYDRA_HOST:HYDRA_PORT`` (default 127.0.0.1:8000).

On SIGTERM / SIGINT uvicorn stops accepting connections, lets in-flight requests
finish (up to ``--graceful-timeout`` seconds), then the app's lifespan drains the
batch queues and stops the model workers; uvicorn then re-raises the signal, so
the exit status says which signal stopped the server. Exit status 3: it refused
to start (the log names the bad artifact file or setting); 2: invalid settings.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Validate the settings, then run uvicorn until a signal stops it; the exit status is 0 on a clean stop."""
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__.splitlines()[0])
    p.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    args = p.parse_args(argv)

    import uvicorn

    from .settings import Settings

    try:
        settings = Settings()
    except ValidationError as e:
        print(f"invalid HYDRA_* settings:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .main import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=args.graceful_timeout,
        lifespan="on",
        access_log=settings.log_level == "debug",
        server_header=False,
    )
    server = uvicorn.Server(config)
    server.run()
    # uvicorn sets started only when the lifespan finished its startup: not started = refused to start
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
