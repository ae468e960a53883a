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

A folder of ``HYDRA_ARTIFACTS`` that has no manifest yet but a builder's note beside it (:mod:`service.core.building`:
``make serve`` serves its first default model while it builds the others) is a model being built: the server starts
without it, says so in ``/readyz`` and ``/v1/models``, answers a request for it 503 ``not_ready`` naming it, and
loads it once its build is done (:func:`watch_builds`). Ready means every model that is built is loaded and warm.

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
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from service.core.artifact import ArtifactError
from service.core.backends import BackendConfigError
from service.core.building import BuildNote, builder_alive, read_note
from service.core.errors import InvalidInput, NotReady
from service.fleet import all_ready
from service.metrics import Metrics
from service.runtime import Runtime, open_runtime
from service.settings import Settings
from service.store import PredictionStore, open_store

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
    "try_line",
    "watch_builds",
]

BUILD_POLL_S = 1.0  # how often the server looks whether a model being built is done

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
    # artifact folder -> its builder's note: models being built, loaded when done (watch_builds)
    building: dict[str, BuildNote] = field(default_factory=dict)
    # model name -> why its build gave no model to serve
    build_failed: dict[str, str] = field(default_factory=dict)
    watcher: asyncio.Task | None = None

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
    state.building.clear()
    state.build_failed.clear()
    state.ready, state.load_error, state.loader = False, None, None
    try:
        for path in s.artifacts:
            note = read_note(path)
            if note is not None and not (Path(path) / "manifest.json").is_file():
                state.building[path] = note
                log.info("%s is being built (%s); served once built", note.name, path)
                continue
            rt = await _open(state, path)
            state.runtimes[rt.name] = rt
        if state.runtimes:
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
    """Load every verified runtime (worker threads: the event loop keeps answering), warm each up, set ready; then
    watch the models being built, if any (:func:`watch_builds`)."""
    for rt in state.runtimes.values():
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(rt.load)
        log.info("%s loaded in %.2f s", rt.name, time.perf_counter() - t0)
    for rt in state.runtimes.values():
        rt.start()
    for rt in state.runtimes.values():
        await _warm(state, rt)
    if state.runtimes:
        _set_ready(state, list(state.runtimes.values()))
    if state.building:
        state.watcher = asyncio.get_running_loop().create_task(watch_builds(state), name="hydra-builds")


async def _warm(state: ServerState, rt: Runtime) -> None:
    t0 = time.perf_counter()
    await rt.warmup()
    d = rt.describe()
    info = (rt.name, rt.version, rt.family, rt.task, d["backend"], d["device"], d["precision"])
    state.metrics.model_info.labels(*info).set(1)
    log.info("%s warmed up in %.2f s", rt.name, time.perf_counter() - t0)


def _set_ready(state: ServerState, new: list[Runtime]) -> None:
    """Ready (again: a model whose build finished joined), with the line that says what to try next."""
    first = not state.ready
    state.ready = True
    state.metrics.ready.set(1.0)  # also read at every scrape (/metrics): with several workers, each one's value counts
    building = [n.name for n in state.building.values()]
    log.info(
        "ready: %s%s",
        ", ".join(state.runtimes),
        f" (still being built: {', '.join(building)})" if building else "",
    )
    for rt in new:
        log.info("try: %s", try_line(rt, state.settings))
    if first and state.on_ready is not None:
        state.on_ready()


def try_line(rt: Runtime, settings: Settings) -> str:
    """A command that asks ``rt`` for an answer, with an input that ships in the repository (docs/images/)."""
    host = "localhost" if settings.host in ("127.0.0.1", "0.0.0.0", "::") else settings.host
    url = f"{host}:{settings.port}"
    if rt.task == "zero-shot":
        return f"""curl -s {url}/zero-shot -F file=@docs/images/trouser.png -F 'labels=["trousers","shirt","dress"]'"""
    if rt.modality == "image":
        return f"curl -s {url}/predict -F file=@docs/images/trouser.png -F model={rt.name}"
    body = json.dumps({"text": "what a wonderful day", "model": rt.name})
    return f"curl -s {url}/predict -H 'content-type: application/json' -d '{body}'"


async def watch_builds(state: ServerState) -> None:
    """Load each model being built once its builder removes its note (the artifact is complete), until none is
    left. A build whose builder process is gone, or that ended without a manifest, or whose artifact does not
    verify, is named in ``build_failed`` (``/readyz``, ``/v1/models``); the models already served go on."""
    while state.building:
        await asyncio.sleep(BUILD_POLL_S)
        for path, note in list(state.building.items()):
            current = read_note(path)
            built = (Path(path) / "manifest.json").is_file()
            if current is not None and builder_alive(current):
                continue
            del state.building[path]
            if current is not None:
                why = f"its build stopped (builder process {current.pid} is gone); run `make serve` again"
            elif not built:
                why = f"its build ended without an artifact in {path}; the builder's log says why"
            else:
                rt = None
                try:
                    rt = await _open(state, path)
                    await _attach_monitor(state, rt)
                    await anyio.to_thread.run_sync(rt.load)
                    rt.start()
                    await _warm(state, rt)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    why = f"its artifact could not be served: {e}"
                    if rt is not None:
                        await rt.close()  # its batcher's worker, if it started
                else:
                    state.runtimes[rt.name] = rt
                    _set_ready(state, [rt])
                    continue
            state.build_failed[note.name] = why
            log.error("%s is not served: %s", note.name, why)


async def _open(state: ServerState, path: str) -> Runtime:
    """The verified runtime of the artifact at ``path`` (:func:`open_runtime`), whose name no other model has."""
    rt = await anyio.to_thread.run_sync(open_runtime, path, state.settings, state.metrics)
    if rt.name in state.runtimes:
        raise StartupError(f"{path}: model name {rt.name!r} is already used by another artifact")
    return rt


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
    for attr in ("watcher", "loader"):
        task = getattr(state, attr)
        setattr(state, attr, None)
        if task is not None and not task.done():
            task.cancel()  # a model being read in a worker thread finishes first
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
        await _attach_monitor(state, rt)


async def _attach_monitor(state: ServerState, rt: Runtime) -> None:
    """Give ``rt`` its live monitor over the open store (none: nothing to do), its shared state read once."""
    if state.store is None:
        return
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
        if state.building and not state.runtimes:
            names = ", ".join(n.name for n in state.building.values())
            return f"not ready: every model is still being built ({names}); the first is served once built"
        if state.build_failed and not state.runtimes and not state.building:
            return (
                f"not ready: no model could be built ({'; '.join(f'{k}: {v}' for k, v in state.build_failed.items())})"
            )
        return "not ready: models are loading or warming up, or the server is shutting down"
    bad = state.unhealthy()
    if bad:
        s = state.settings
        return (
            f"not ready: model(s) {', '.join(bad)} failed {s.unready_after_failures} or more batches in a row; "
            f"a probe batch runs every {s.probe_interval_s:g} s until one succeeds"
        )
    unread = [f"{n}: {rt.drift_error}" for n, rt in state.runtimes.items() if rt.drift_error]
    if unread:
        return "not ready: the drift alarm's shared state cannot be read (" + "; ".join(unread) + "); answers abstain"
    fleet = all_ready()  # a worker of several (HYDRA_WORKERS): ready when every worker is
    if fleet is not None and fleet[0] < fleet[1]:
        return f"not ready: {fleet[0]} of {fleet[1]} workers ready (HYDRA_WORKERS)"
    return None


def pick(state: ServerState, name: str | None, modality: str, task: str) -> Runtime:
    """The runtime named ``name``, else the only one of this task and modality; 400 when none or ambiguous.

    Without a name, a runtime of the endpoint's own task comes first; only when there is none does one that also
    answers it (:meth:`Runtime.answers`: a zero-shot model's fixed labels on ``/predict``) serve.
    """
    if name is not None:
        being_built(state, name=name)
    if not state.ready:
        if state.load_error is not None:
            raise NotReady("the server cannot serve: loading the models failed; it is stopping")
        being_built(state, modality=modality, task=task)
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
        being_built(state, modality=modality, task=task)
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


def being_built(state: ServerState, name: str | None = None, modality: str = "", task: str = "") -> None:
    """Raise 503 ``not_ready`` naming the model being built (or whose build failed) that the request is for: the one
    named ``name``, else one of this modality that answers ``task``. Nothing when there is none."""
    for note in state.building.values():
        fits = note.name == name if name is not None else note.modality == modality and note.task == task
        if fits:
            d = note.describe()
            raise NotReady(
                f"model {note.name!r} is still being built ({d['elapsed_s']:.0f} s so far, about {d['eta_s']:.0f} s "
                "left); it is served as soon as its build finishes: retry then"
            )
    if name is not None and name in state.build_failed:
        raise NotReady(f"model {name!r} is not served: {state.build_failed[name]}")
