"""The FastAPI app (docs/api.md): ``create_app(settings)``; ``service.main:app`` for uvicorn.

Start-up: the lifespan verifies every artifact of ``HYDRA_ARTIFACTS`` (manifest,
every file's size and sha256, settings against the artifact) and refuses to start,
naming the file, when one is missing or corrupt. Then the models are loaded and
warmed up through the full path, by default in the background once the server
accepts connections (``HYDRA_LOAD_IN_BACKGROUND``): ``/healthz`` answers 200
throughout, ``/readyz`` and the inference endpoints 503 ``not_ready`` until every
model is warm. If loading fails there, the error is logged, ``/readyz`` stays 503
and ``ServerState.on_fatal`` is called (``python -m service`` then stops with a
non-zero status, so that the orchestrator restarts it).

Readiness also goes false while a model is unhealthy (``HYDRA_UNREADY_AFTER_FAILURES``
failed batches in a row, until a probe batch succeeds; :class:`service.runtime.Runtime`).

The app is assembled here from one module per concern: :mod:`service.api.middleware` (request
IDs and the access log, auth, body limit, request metrics), :mod:`service.lifecycle` (state,
start-up, shutdown, model picking), :mod:`service.api.v1` (the HTTP API's handlers) and
:mod:`service.api.oip` (the Open Inference Protocol's), both over :mod:`service.api.dataplane`
(the one inference path), :mod:`service.tracing` (request IDs, trace context, OpenTelemetry
with ``HYDRA_OTEL``) and :mod:`service.api.error_bodies` (the error body). Handlers reach the loaded
models through ``request.app.state.hydra``.
"""

from __future__ import annotations

import os

# Idle OpenMP threads (torch) sleep instead of spinning: the event loop, tokenizers and ONNX Runtime share these
# cores, and spinning threads on a busy or shared machine slow small ops by 10x or more. Only effective when this
# module is the first to import torch (uvicorn service.main:app, python -m service); set it in the environment to
# choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Large CPU tensors (the activations every forward allocates and frees; the fused model's member-stacked ones are
# M times one model's) go on transparent huge pages: glibc maps them afresh each call, and 4 KiB pages cost one
# fault each (16k per 64 MiB tensor, 10-15% system time on the 2-core machines here) where 2 MiB pages cost 32.
# torch reads this on its first allocation: same import-order caveat as above.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# the imports below load torch (through the runtimes): after the environment defaults above
from functools import partial

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.error_bodies import install_error_handlers
from service.api.middleware import Front
from service.api.oip import install_oip_routes
from service.api.v1 import FAST_ROUTES, install_routes
from service.lifecycle import ServerState, lifespan
from service.metrics import Metrics
from service.settings import Settings
from service.tracing import instrument

__all__ = ["HydraApp", "create_app", "app"]


class HydraApp(FastAPI):
    """FastAPI, with :class:`~service.api.middleware.Front` around all of it (Starlette's error middleware and
    OpenTelemetry's included), so that a request's ID is on every answer and its access line sees the final status;
    the JSON inference requests are answered there (its fast routes)."""

    context: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.context is None:
            await super().__call__(scope, receive, send)
        else:
            await self.context(scope, receive, send)


def create_app(settings: Settings | None = None) -> HydraApp:
    """The app; loading happens in its lifespan (``with TestClient(app)`` or a server), not here."""
    settings = settings if settings is not None else Settings()
    state = ServerState(settings=settings, metrics=Metrics())
    app = HydraApp(
        title="hydra-serve",
        version="0.1.0",
        description="Uncertainty-aware inference with Hydra ensembles: predictions with MSP, entropy, "
        "mutual information, member disagreement and a calibrated OOD flag.",
        lifespan=lifespan(state),
        docs_url=None,  # /docs is service.api.v1.install_docs': Swagger UI from the app itself, not from a CDN
        redoc_url=None,  # ReDoc would load from a CDN, and no pinned package ships it
    )
    app.state.hydra = state
    install_error_handlers(app)
    install_routes(app)
    install_oip_routes(app)
    if settings.otel:
        instrument(app)
    context: ASGIApp = Front(partial(FastAPI.__call__, app), state, FAST_ROUTES, app)
    if settings.cors_origins:  # outermost, so that 401/413 answers carry CORS headers too
        context = CORSMiddleware(
            context,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID", "traceparent"],
            expose_headers=["X-Request-ID"],
        )
    app.context = context
    return app


app = create_app()
