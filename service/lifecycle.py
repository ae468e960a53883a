"""The server's lifecycle: its shared state, start-up, loading, shutdown, and which model answers a request.

Start-up (:func:`startup`, the app's lifespan) verifies every artifact of ``HYDRA_ARTIFACTS``
(manifest, every file's size and sha256, settings against the artifact) and refuses to
start, naming the file, when one is missing or corrupt (:class:`StartupError`). Then the
models are loaded and warmed up through the full path (:func:`load_and_warm`): by default in
the background once the server accepts connections (``HYDRA_LOAD_IN_BACKGROUND``,
:func:`load_in_background`). Until every model is warm, ``/readyz`` and the inference
endpoints answer 503 ``not_ready`` (docs/api.md). If background loading fails, the error is
logged, ``/readyz`` stays 503 and :attr:`ServerState.on_fatal` is called (``python -m service``
then stops with a non-zero status, so that the orchestrator restarts it).

Shutdown (:func:`shutdown`) stops answering ready, cancels loading, lets every queued
request be answered and stops the model workers.

The prediction store (:mod:`service.store`, ``HYDRA_STORE``) is opened at start-up and each model gets its live
monitor (:meth:`Runtime.attach_monitor`). A store that cannot be opened does not stop the server: the error is
logged, predictions are served unrecorded, and feedback answers 503 (:attr:`ServerState.store_error`). At shutdown
the store is closed after the runtimes, so every answer recorded and every acknowledged label is on disk first.

:func:`pick` chooses the runtime of a request: the one named, else the only one that takes
the request's task and modality.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from .core.artifact import ArtifactError
from .core.backends import BackendConfigError
from .core.errors import InvalidInput, NotReady
from .fleet import all_ready
from .metrics import Metrics
from .runtime import Runtime, open_runtime
from .settings import Settings
from .store import PredictionStore, open_store

__all__ = [
    "ServerState",
    "StartupError",
    "lifespan",
    "load_and_warm",
    "load_in_background",
    "open_monitors",
    "pick",
    "not_ready_reason",
    "shutdown",
    "startup",
]

log = logging.getLogger("hydra.service")


class StartupError(RuntimeError):
    """The server refuses to start; the message says which artifact or setting is wrong."""


@dataclass
class ServerState:
    """What the handlers share: settings, metrics, the runtimes and the server's lifecycle."""

    settings: Settings
    metrics: Metrics
    runtimes: dict[str, Runtime] = field(default_factory=dict)
    # every model loaded and warmed up, and not shutting down
    ready: bool = False
    # why loading in the background failed (the server cannot serve and should be restarted)
    load_error: str | None = None
    # called (on the event loop) with load_error when background loading fails; python -m service stops the server
    on_fatal: Callable[[str], None] | None = None
    # called (on the event loop) once every model is loaded and warm; python -m service settles its heap then
    on_ready: Callable[[], None] | None = None
    loader: asyncio.Task | None = None
    # HTTP requests received / answered (a response sent to the end), for the shutdown log and the SIGTERM check
    requests_received: int = 0
    requests_answered: int = 0
    # the prediction store (None: off, or it could not be opened: store_error says why)
    store: PredictionStore | None = None
    store_error: str | None = None

    def unhealthy(self) -> list[str]:
        """Names of the loaded models that failed their last batches (not ready until a probe batch runs)."""
        return [name for name, rt in self.runtimes.items() if not rt.healthy]

    @property
    def serving(self) -> bool:
        """What ``/readyz`` answers: ready and every model healthy."""
        return self.ready and not self.unhealthy()


def lifespan(state: ServerState) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """The app's lifespan: :func:`startup` on entry, :func:`shutdown` on exit."""

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        await startup(state)
        try:
            yield
        finally:
            await shutdown(state)

    return run


async def startup(state: ServerState) -> None:
    """Verify every artifact (refusing to start, naming the file), then load and warm up: in the background
    (``HYDRA_LOAD_IN_BACKGROUND``, the default) or before returning."""
    s = state.settings
    logging.getLogger("hydra").setLevel(s.log_level.upper())
    if s.threads:
        torch.set_num_threads(s.threads)
    if not s.artifacts:
        raise StartupError("HYDRA_ARTIFACTS is empty: set it to a comma-separated list of artifact directories")
    # a lifespan may run again on the same app (test clients): start from nothing loaded
    state.runtimes.clear()
    state.ready, state.load_error, state.loader = False, None, None
    try:
        for path in s.artifacts:
            rt = await anyio.to_thread.run_sync(open_runtime, path, s, state.metrics)
            if rt.name in state.runtimes:
                raise StartupError(f"{path}: model name {rt.name!r} is already used by another artifact")
            state.runtimes[rt.name] = rt
        log.info("verified: %s", ", ".join(f"{n} ({rt.root})" for n, rt in state.runtimes.items()))
        await open_monitors(state)
        if s.load_in_background:
            state.loader = asyncio.get_running_loop().create_task(load_in_background(state), name="hydra-load")
            log.info("loading and warming up in the background; /readyz answers 503 until done")
            return
        await load_and_warm(state)
    except (ArtifactError, BackendConfigError, StartupError) as e:
        log.error("refusing to start: %s", e)
        await shutdown(state)
        raise StartupError(f"refusing to start: {e}") from e
    except BaseException:
        log.exception("refusing to start")
        await shutdown(state)
        raise


async def load_and_warm(state: ServerState) -> None:
    """Load every verified runtime (worker threads: the event loop keeps answering), warm each up, set ready."""
    for rt in state.runtimes.values():
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(rt.load)
        log.info("%s loaded in %.2f s", rt.name, time.perf_counter() - t0)
    for rt in state.runtimes.values():
        rt.start()
    for rt in state.runtimes.values():
        t0 = time.perf_counter()
        await rt.warmup()
        d = rt.describe()
        info = (rt.name, rt.version, rt.family, rt.task, d["backend"], d["device"], d["precision"])
        state.metrics.model_info.labels(*info).set(1)
        log.info("%s warmed up in %.2f s", rt.name, time.perf_counter() - t0)
    state.ready = True
    state.metrics.ready.set(1.0)  # also read at every scrape (/metrics): with several workers, each one's value counts
    log.info("ready: %s", ", ".join(state.runtimes))
    if state.on_ready is not None:
        state.on_ready()


async def load_in_background(state: ServerState) -> None:
    """:func:`load_and_warm` after the port is bound; a failure leaves the server not ready and calls on_fatal."""
    try:
        await load_and_warm(state)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if isinstance(e, (ArtifactError, BackendConfigError)):
            log.error("cannot serve: loading failed: %s", e)
        else:
            log.exception("cannot serve: loading failed")
        state.load_error = f"{type(e).__name__}: {e}"
        if state.on_fatal is not None:
            state.on_fatal(state.load_error)
        else:
            log.error("not ready for good: /readyz answers 503; restart the server")


async def shutdown(state: ServerState) -> None:
    """Not ready any more; stop loading, finish what is queued, then stop the workers."""
    state.ready = False
    state.metrics.ready.set(0.0)
    loader, state.loader = state.loader, None
    if loader is not None and not loader.done():
        loader.cancel()  # a model being read in a worker thread finishes first
        with contextlib.suppress(asyncio.CancelledError):
            await loader
    for rt in list(state.runtimes.values()):
        await rt.close()
    store, state.store = state.store, None
    if store is not None:  # after the runtimes: every answer they gave is queued; write it all
        await store.aclose()
    if state.runtimes:
        log.info(
            "stopped: every queued request answered, model workers stopped (%d requests received, %d answered)",
            state.requests_received,
            state.requests_answered,
        )


async def open_monitors(state: ServerState) -> None:
    """Open the prediction store (a failure is logged, not raised: the server serves without it) and give every
    model its live monitor, its shared state read once (a store that is down is read again later)."""
    state.store, state.store_error = None, None
    if not state.settings.store:
        return
    try:
        state.store = await anyio.to_thread.run_sync(open_store, state.settings)
    except Exception as e:  # a bad URL, a folder that cannot be written: serve, unrecorded
        state.store_error = f"{type(e).__name__}: {e}"
        log.error("prediction store not opened (%s): predictions are not recorded, feedback answers 503", e)
        return
    if state.store is None:
        return
    log.info("prediction store: %s (%s)", state.store.backend, state.store.where)
    for rt in state.runtimes.values():
        monitor = rt.attach_monitor(state.store)
        try:
            await anyio.to_thread.run_sync(monitor.apply)
        except Exception as e:
            log.warning("%s: monitor state not read at start-up (%s); read on the next feedback", rt.name, e)


def not_ready_reason(state: ServerState) -> str | None:
    """Why the server is not ready (``/readyz``, ``/v2/health/ready`` answer 503 with it); None when it is."""
    if state.load_error is not None:
        return "not ready: loading the models failed (the server log has the details); restart it"
    if not state.ready:
        return "not ready: models are loading or warming up, or the server is shutting down"
    bad = state.unhealthy()
    if bad:
        s = state.settings
        return (
            f"not ready: model(s) {', '.join(bad)} failed {s.unready_after_failures} or more batches in a row; "
            f"a probe batch runs every {s.probe_interval_s:g} s until one succeeds"
        )
    fleet = all_ready()  # a worker of several (HYDRA_WORKERS): ready when every worker is
    if fleet is not None and fleet[0] < fleet[1]:
        return f"not ready: {fleet[0]} of {fleet[1]} workers ready (HYDRA_WORKERS)"
    return None


def pick(state: ServerState, name: str | None, modality: str, task: str) -> Runtime:
    """The runtime named ``name``, else the only one of this task and modality; 400 when none or ambiguous.

    Without a name, a runtime of the endpoint's own task comes first; only when there is none does one that also
    answers it (:meth:`Runtime.answers`: a zero-shot model's fixed labels on ``/predict``) serve.
    """
    if not state.ready:
        if state.load_error is not None:
            raise NotReady("the server cannot serve: loading the models failed; it is stopping")
        raise NotReady("the server is not ready (loading models or shutting down); retry shortly")
    if name is not None:
        rt = state.runtimes.get(name)
        if rt is None:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise InvalidInput(f"model: unknown model {shown!r}; loaded: {sorted(state.runtimes)}")
        if not rt.answers(task):
            other = "/predict" if rt.task == "classification" else "/zero-shot"
            raise InvalidInput(f"model: {name!r} is a {rt.task} model; send it to {other}")
        if rt.modality != modality:
            raise InvalidInput(f"model: {name!r} takes {rt.modality} inputs, not {modality}")
        return rt
    fits = [rt for rt in state.runtimes.values() if rt.task == task and rt.modality == modality]
    if not fits:
        fits = [rt for rt in state.runtimes.values() if rt.answers(task) and rt.modality == modality]
    if not fits:
        if task == "zero-shot":
            raise InvalidInput(
                "no zero-shot model is loaded; start the server with a zero-shot artifact "
                "(task: zero-shot, family clip) in HYDRA_ARTIFACTS, or use /predict"
            )
        raise InvalidInput(f"no loaded model takes {modality} inputs; loaded: {sorted(state.runtimes)}")
    if len(fits) > 1:
        raise InvalidInput(
            f"several models take {modality} inputs ({sorted(r.name for r in fits)}); choose one with 'model'"
        )
    return fits[0]
