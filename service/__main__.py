"""``python -m service``: serve ``HYDRA_ARTIFACTS`` on ``HYDRA_HOST:HYDRA_PORT`` (default 127.0.0.1:8000).

Start-up: the artifacts are verified before the port is bound, then loaded and
warmed up in the background (``/healthz`` 200, ``/readyz`` 503 meanwhile).
On SIGTERM / SIGINT the server stops accepting connections, lets in-flight
requests finish (up to ``--graceful-timeout`` seconds), then the app's lifespan
drains the batch queues and stops the model workers, and the process exits 0.

Exit status: 0 stopped by a signal after a graceful shutdown; 1 forced stop (a
second SIGINT); 2 invalid settings; 3 refused to
start (the log names the bad artifact file or setting); 4 loading or warming up
a model failed after start-up (the log says why; restart after fixing it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from pydantic import ValidationError

from .settings import Settings

__all__ = ["main", "EXIT_OK", "EXIT_FORCED", "EXIT_SETTINGS", "EXIT_REFUSED", "EXIT_LOAD_FAILED"]

EXIT_OK, EXIT_FORCED, EXIT_SETTINGS, EXIT_REFUSED, EXIT_LOAD_FAILED = 0, 1, 2, 3, 4

log = logging.getLogger("hydra.service")


def _server_class() -> type:
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    class Server(uvicorn.Server):
        """uvicorn's server, except that a stop by signal ends ``serve()`` normally instead of re-raising the
        signal afterwards (uvicorn's default, which makes the exit status say "killed by SIGTERM")."""

        stop_signal: int | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
                log.info("received %s: graceful shutdown", signal.Signals(sig).name)
            super().handle_exit(sig, frame)

    return Server


def main(argv: list[str] | None = None) -> int:
    """Validate the settings, then run uvicorn until a signal stops it; the exit status is 0 on a clean stop."""
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__.splitlines()[0])
    p.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    args = p.parse_args(argv)

    import uvicorn

    try:
        settings = Settings()
    except ValidationError as e:
        print(f"invalid HYDRA_* settings:\n{e}", file=sys.stderr)
        return EXIT_SETTINGS
    # imported once the settings are known to be valid: service.main builds its module-level `app` (for uvicorn
    # service.main:app) from the environment at import, and loads torch
    from .logs import configure_logging
    from .main import create_app

    configure_logging(settings)
    app = create_app(settings)
    json_logs = settings.log_format == "json"
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # asyncio and h11, the image's (uvloop and httptools are optional extras uvicorn would pick when present)
        loop="asyncio",
        http="h11",
        log_level=settings.log_level,
        # JSON logs: uvicorn's loggers go through the root handler (JSON) instead of their own text handlers
        log_config=None if json_logs else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=args.graceful_timeout,
        lifespan="on",
        # the server's own access line (service.logs) replaces uvicorn's with JSON logs
        access_log=settings.log_level == "debug" and not json_logs,
        server_header=False,
    )
    server = _server_class()(config)
    state = app.state.hydra

    def fatal(reason: str) -> None:  # background loading failed: stop serving, exit non-zero
        server.should_exit = True

    state.on_fatal = fatal
    try:
        server.run()
    except SystemExit as e:  # uvicorn: the lifespan start-up failed (our log names the file)
        return e.code if isinstance(e.code, int) and e.code else EXIT_REFUSED
    if state.load_error is not None:
        log.error("exiting with status %d: %s", EXIT_LOAD_FAILED, state.load_error)
        return EXIT_LOAD_FAILED
    if not server.started:
        return EXIT_REFUSED
    if server.force_exit:
        return EXIT_FORCED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
