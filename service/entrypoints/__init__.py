"""How the server starts: the process wiring and the app factory, in one room above the server's layers.

``python -m service`` (``hydra-serve``) serves ``HYDRA_ARTIFACTS`` on ``HYDRA_HOST:HYDRA_PORT`` (default
127.0.0.1:8000). The path, one module a step:

1. :mod:`.cli`: the command line; the settings validated before anything loads (exit 2 when they are invalid);
2. :mod:`.workers`: with ``HYDRA_WORKERS`` above 1 this process becomes a supervisor that binds the socket and runs
   that many server processes on it (the design, and what holds across workers, is its docstring);
3. :mod:`.serving`: one server process: the artifacts verified before the port is bound, then loaded and warmed up
   in the background (``/healthz`` 200, ``/readyz`` 503 meanwhile); once ready, what start-up allocated is frozen
   out of the garbage collector's scans (:func:`~service.entrypoints.serving.freeze_startup_heap`) and a worker
   marks itself ready (:mod:`service.fleet`);
4. :mod:`.http_server`: uvicorn on uvloop and httptools when they import (``HYDRA_LOOP``, ``HYDRA_HTTP``), and a
   SIGTERM that refuses new connections, answers those already queued, lets in-flight requests finish (up to
   ``--graceful-timeout`` seconds) and then lets the app's lifespan drain the batch queues: nothing is reset;
5. :mod:`.app`: ``create_app(settings)``, the FastAPI app assembled from the server's rooms (``service.main:app``
   is its documented name for uvicorn and friends).

Exit status: 0 stopped by a signal after a graceful shutdown; 1 forced stop (a second SIGINT); 2 invalid settings;
3 refused to start (the log names the bad artifact file or setting); 4 loading or warming up a model failed after
start-up (the log says why; restart after fixing it).

May import every layer of the server; nothing of the server imports it (``service/__main__.py`` and
``service/main.py`` only re-export it, under the names the contract documents).
"""
