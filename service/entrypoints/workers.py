"""Several server processes on one port (``HYDRA_WORKERS``): N full replicas sharing the listening socket.

**The design.** ``python -m service`` with ``HYDRA_WORKERS`` above 1 becomes a supervisor: it binds the socket, then
starts N worker processes (``spawn``), each a whole server (the models loaded, its own batcher, event loop and drift
alarm) accepting from that one socket, the kernel handing each new connection to one of them. Workers share what
replicas share, through the prediction store (the adaptive sets' and the online rules' state, the labels, the live
figures), so every route answers as a replica does. The other design, N API processes feeding one engine process per
device (vLLM's, LitServe's), keeps one copy of the model and fuller batches, at the price of a hop between processes
for every request (its inputs and results serialised both ways) and of one more process to supervise; a replica
per worker adds what its cores give without the hop. ``benchmarks/gpu.sh`` measures 1 to 8 workers on a GPU.

**``auto`` on CPU is one worker per core** (the cores this process may run on), each with one thread. Measured on
2 CPU cores (``benchmarks/results/server/*-workers.md``), two workers of one thread each answer 1.3 to 1.6 times what
one worker of two threads does on the default models, at 32 to 256 connections: one worker's Python overlaps the
other's model. The workers share one drift alarm per model (:mod:`service.core.drift_shared`: a state file in the
supervisor's folder, advanced under a lock), so a shift is caught after as many inputs as with one worker, with the
same false-alarm bound; that is what lets ``auto`` take every core. Each worker holds its own copy of the models
(docs/api.md, "Workers", gives the memory per worker).

**What holds across workers.** One drift alarm per model watches all the workers' traffic and every answer reads it
(docs/api.md, "The drift alarm and the answers"); a worker that dies takes with it only its requests in flight, the
alarm's evidence stays in the shared file; ``/metrics`` is one view of all workers (prometheus_client's
multiprocess mode: counters and histograms summed, each gauge combined as its metric says, :mod:`service.metrics`);
``/readyz`` answers 200 only when every worker is ready (:func:`service.fleet.all_ready`, each worker's mark in a
folder the supervisor makes); SIGTERM or SIGINT reaches every worker, each drains as one server does
(:class:`service.entrypoints.http_server.Server`) and the supervisor waits for all of them; a worker that dies is
replaced (its requests in flight are lost, the others keep answering), unless it dies before it ever was ready: then the
configuration is wrong, every worker stops and the supervisor exits with the worker's status. A worker loads its
models before it takes connections (``HYDRA_LOAD_IN_BACKGROUND`` is false for workers), so that a replacement
warming up takes no traffic; ``/healthz`` then answers once the first worker has loaded (a Kubernetes startup probe
should allow for it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from service.entrypoints.serving import EXIT_REFUSED, serve
from service.fleet import READY_DIR_ENV, WORKERS_ENV

__all__ = ["resolve_workers", "supervise", "usable_cores"]

log = logging.getLogger("hydra.service")

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode reads it at import
RESTART_LIMIT = 10  # worker replacements per minute before the supervisor gives up
POLL_S = 0.2


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or ``taskset``'s limit), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_workers(value: int | str, device: str) -> int:
    """``HYDRA_WORKERS``: a count, or ``auto``: on CPU one per core this process may run on (the workers share one
    drift alarm: module docstring), and on CUDA a worker per two cores, at most 8 (the Python frontend bounds it
    there: one process answers about a thousand requests a second)."""
    if value != "auto":
        return int(value)
    cores = usable_cores()
    if device == "cpu":
        return max(1, cores)
    try:
        import torch

        cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    except ImportError:
        cuda = False
    return max(1, min(8, cores // 2)) if cuda else max(1, cores)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _worker(sock: socket.socket, graceful: float) -> None:
    """A worker process: the whole server on the supervisor's socket (:func:`service.entrypoints.serving.serve`)."""
    sys.exit(serve(graceful, sockets=[sock]))


class Supervisor:
    """Starts, watches and stops the workers (module docstring)."""

    def __init__(self, n: int, sock: socket.socket, graceful: float) -> None:
        self.n, self.sock, self.graceful = n, sock, graceful
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.stopping = False
        self.restarts: list[float] = []

    def start(self) -> Any:
        p = self.ctx.Process(target=_worker, args=(self.sock, self.graceful), name="hydra-worker", daemon=False)
        p.start()
        log.info("worker %d started", p.pid)
        return p

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self.stopping:
            log.info("received %s: stopping %d workers", signal.Signals(sig).name, len(self.procs))
        self.stopping = True
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def run(self) -> int:
        """Until a signal: keep N workers; then stop them all. The exit status (0 after a clean stop)."""
        self.procs = [self.start() for _ in range(self.n)]
        status = 0
        while not self.stopping:
            time.sleep(POLL_S)
            for i, p in enumerate(self.procs):
                if p.is_alive() or self.stopping:
                    continue
                was_ready = (Path(os.environ[READY_DIR_ENV]) / f"ready-{p.pid}").exists()
                mark = Path(os.environ[READY_DIR_ENV]) / f"ready-{p.pid}"
                mark.unlink(missing_ok=True)
                _dead(p.pid)
                if not was_ready and p.exitcode not in (None, 0, -signal.SIGKILL, -signal.SIGTERM):
                    log.error("worker %d exited with status %s before it was ready: stopping", p.pid, p.exitcode)
                    status = p.exitcode if p.exitcode and p.exitcode > 0 else EXIT_REFUSED
                    self.on_signal(signal.SIGTERM, None)
                    break
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < 60] + [now]
                if len(self.restarts) > RESTART_LIMIT:
                    log.error("%d workers died within a minute: stopping", len(self.restarts))
                    status = EXIT_REFUSED
                    self.on_signal(signal.SIGTERM, None)
                    break
                log.error("worker %d died (status %s): starting a replacement", p.pid, p.exitcode)
                self.procs[i] = self.start()
        deadline = time.monotonic() + self.graceful + 30
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("worker %d did not stop in time: killing it", p.pid)
                p.kill()
                p.join(5)
            elif p.exitcode and not status:
                status = p.exitcode
        return status


def _dead(pid: int) -> None:
    """prometheus_client's multiprocess mode: a dead worker's live gauges leave the view."""
    if os.environ.get(METRICS_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def supervise(n: int, host: str, port: int, graceful: float) -> int:
    """Serve with ``n`` workers on ``host:port`` until a signal (module docstring); the exit status."""
    tmp = Path(tempfile.mkdtemp(prefix="hydra-workers-"))
    (tmp / "metrics").mkdir()
    (tmp / "ready").mkdir()
    # what the workers inherit; put back when the supervisor returns (it may run inside a longer-lived process)
    keys = (METRICS_ENV, READY_DIR_ENV, WORKERS_ENV, "HYDRA_THREADS", "HYDRA_LOAD_IN_BACKGROUND")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        return _supervise(n, host, port, graceful, tmp)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)


def _supervise(n: int, host: str, port: int, graceful: float, tmp: Path) -> int:
    os.environ[METRICS_ENV] = str(tmp / "metrics")
    os.environ[READY_DIR_ENV] = str(tmp / "ready")
    os.environ[WORKERS_ENV] = str(n)
    if not os.environ.get("HYDRA_THREADS"):  # the cores shared out, not each worker's torch on all of them
        os.environ["HYDRA_THREADS"] = str(max(1, usable_cores() // n))
    # a worker loads its models before it takes connections from the shared socket: a replacement warming up would
    # otherwise take its share of the traffic and answer 503 while the others could answer
    os.environ["HYDRA_LOAD_IN_BACKGROUND"] = "false"
    try:
        sock = _bind(host, port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e)
        return EXIT_REFUSED
    sup = Supervisor(n, sock, graceful)
    original = {sig: signal.signal(sig, sup.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("%d workers on %s:%d (HYDRA_WORKERS)", n, host, port)
    try:
        return sup.run()
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)
        sock.close()
