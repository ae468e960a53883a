"""Dynamic batching: requests for one model are queued and run together, off the event loop.

A batch starts when enough inputs are waiting or ``max_wait_s`` after the oldest
waiting request arrived (or after the worker became free, if later: a request
that arrived during the previous batch waits at most that long for the clients
it answered to come back), whichever comes first. "Enough" is ``max_batch``, or
fewer when recent load was lower: a lone client does not wait for company that
is not coming. While a batch runs, the next one fills up.

How much lower (``fill``): ``in_system`` (the default) counts, for each recent
batch cycle, the most inputs that were in the system at once, queued plus
running, and fills up to the largest such count. ``recent`` fills up to the
largest recent batch. The difference shows at medium load: 8 clients split into
two groups of 4, one running while the other queues. Each queued group reaches
the largest recent batch (4) and starts at once, so ``recent`` keeps the
batches at 4 for good. ``in_system`` sees the 8 inputs in flight and waits for the group just
answered to come back: batches of 8, each one larger and cheaper per input
(``benchmarks/results/batching``). It waits at most ``max_wait_s`` and at most
half the last forward pass (:data:`STRAGGLER_WAIT`): a wait pays only when the
model, not the HTTP handling, is what the clients wait for.

One worker thread per model runs the batches, so the event loop keeps
answering. A lone request (the only HTTP request in the server, as
``in_flight`` counts them; nothing queued, no batch running, at most
``max_batch`` inputs) goes to the worker thread at once, without the hop
through the batching task (an event set, a loop iteration, the fill rule): a
request that arrives meanwhile queues and forms the next batch, which starts
once the lone one is done. The model never runs on the event loop's thread, so
a slow or stuck forward pass leaves the server answering (503s included). The
queue is bounded (``max_queue`` inputs): beyond it :meth:`Batcher.submit`
raises :class:`~service.core.errors.Overloaded` at once.

If a batch raises, the requests in it are retried one by one, so that one bad
input fails only its own request; requests that still fail get
:class:`~service.core.errors.InternalError` (500) and the batcher keeps serving.

Health: a batch in which no request could be run (its retries included) is a
failed batch. After ``unhealthy_after`` failed batches in a row the batcher is
unhealthy (``healthy`` False, ``on_health(False)``) until a batch runs again
(``on_health(True)``); it keeps accepting requests meanwhile, so a request or
the runtime's probe batch can bring it back. Errors the run function raises as
client errors (a :class:`~service.core.errors.ServiceError` below 500) do not count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.core.errors import InternalError, NotReady, Overloaded, ServiceError
from service.metrics import Metrics

__all__ = ["FILL_RULES", "BatchLimits", "Batcher", "BatchResult"]

FILL_RULES = ("in_system", "recent")  # how full a batch waits to be under lower load (module docstring)
# in_system: the longest wait for a batch to fill, as a share of the last forward pass. A wait buys a larger batch
# only when the pass costs more than the clients' round trip: with a model of 1 ms a pass (a tiny test model), the
# 8 clients were busy in HTTP handling, not in the queue, and waiting the full HYDRA_MAX_WAIT_MS halved throughput
STRAGGLER_WAIT = 0.5

log = logging.getLogger("hydra.batching")


@dataclass
class BatchResult:
    """What one request gets back: one result per input, in order, and its timings (seconds)."""

    results: list[Any]
    queue_s: float
    inference_s: float
    batch_size: int


@dataclass(eq=False)
class _Request:
    items: Sequence[Any]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class BatchLimits:
    """How one model's batches form (``HYDRA_MAX_BATCH``, ``HYDRA_MAX_WAIT_MS``, ``HYDRA_MAX_QUEUE``,
    ``HYDRA_BATCH_FILL``; the module docstring says how)."""

    max_batch: int  # most inputs per ``run`` call
    max_wait_s: float  # longest wait of the oldest queued request for its batch to fill
    max_queue: int  # most inputs waiting; more -> Overloaded (503, Retry-After)
    fill: str = "in_system"  # how full a batch waits to be under lower load: one of FILL_RULES

    def __post_init__(self) -> None:
        if self.fill not in FILL_RULES:
            raise ValueError(f"fill must be one of {FILL_RULES}, got {self.fill!r}")


class Batcher:
    """Queue of one model: ``await submit(items)`` -> :class:`BatchResult`.

    Args:
        name: model name (metrics label, messages).
        run: ``run(items) -> results``, one result per item; called in the worker thread
            with at most ``limits.max_batch`` items.
        limits: the batch size, wait, queue bound and fill rule (:class:`BatchLimits`).
        metrics: where batch sizes, inference times, queue waits and depth go.
        unhealthy_after: failed batches in a row that make the batcher unhealthy; 0 = never.
        on_health: called on the event loop with the new value when ``healthy`` changes.
        in_flight: the server's HTTP requests in flight now; with it, a lone request goes to the worker thread
            without queueing (module docstring). None: every request goes through the queue.
    """

    def __init__(
        self,
        name: str,
        run: Callable[[list[Any]], list[Any]],
        limits: BatchLimits,
        *,
        metrics: Metrics | None = None,
        unhealthy_after: int = 0,
        on_health: Callable[[bool], None] | None = None,
        in_flight: Callable[[], int] | None = None,
    ) -> None:
        self.name = name
        self._in_flight = in_flight
        self.fill = limits.fill
        self._running_inputs = 0  # inputs of the batch the worker runs now
        self._cycle_peak = 0  # most inputs in the system (queued + running) since the last batch started
        self._fn = run
        self.max_batch = limits.max_batch
        self.max_wait_s = limits.max_wait_s
        self.max_queue = limits.max_queue
        self.metrics = metrics
        self._queue: deque[_Request] = deque()
        self._depth = 0  # inputs waiting (not yet taken into a batch)
        self._event: asyncio.Event | None = None
        self._lone: asyncio.Future | None = None  # the lone request running in the worker thread (_run_lone)
        self._task: asyncio.Task | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hydra-{name}")
        self._last_batch_s = 0.0
        self._free_since = 0.0  # when the worker last finished a batch
        self._recent: deque[int] = deque(maxlen=8)  # per recent batch: its size, or (in_system) the cycle's peak
        self.unhealthy_after = unhealthy_after
        self._on_health = on_health
        self.consecutive_failures = 0  # failed batches in a row (server-side errors only)
        self.healthy = True

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._closing

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is None:
            self._set_depth(0)  # the queue depth's series exists from the start (a lone request never queues)
            self._event = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    def call_direct(self, items: list[Any]) -> list[Any]:
        """Run ``items`` through the model synchronously, in chunks of ``max_batch`` (no queue)."""
        return self._call(items)

    async def submit(self, items: Sequence[Any]) -> BatchResult:
        """Queue the inputs of one request and wait for their results."""
        if not self.running:
            raise NotReady(f"model {self.name!r} is not accepting requests (starting or shutting down)")
        n = len(items)
        if self._depth + n > self.max_queue:
            retry = max(1, round(self._last_batch_s * (1 + self._depth / self.max_batch)))
            raise Overloaded(
                f"model {self.name!r} is overloaded: {self._depth} inputs queued (limit {self.max_queue}, "
                f"HYDRA_MAX_QUEUE); retry after {retry} s",
                retry_after=retry,
            )
        if self._in_flight is not None and self._in_flight() <= 1 and n <= self.max_batch:
            if not self._queue and not self._running_inputs and not self._closing:
                return await self._run_lone(items)
        req = _Request(items, asyncio.get_running_loop().create_future())
        self._queue.append(req)
        self._set_depth(self._depth + n)
        self._cycle_peak = max(self._cycle_peak, self._depth + self._running_inputs)
        assert self._event is not None
        self._event.set()
        return await req.future  # cancelled with the request: the loop skips it

    async def close(self) -> None:
        """Stop accepting, finish everything queued, stop the worker thread."""
        self._closing = True
        if self._task is not None:
            assert self._event is not None
            self._event.set()
            await self._task
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        if self.metrics is not None:
            self.metrics.queue_depth.labels(self.name).set(depth)

    async def _loop(self) -> None:
        assert self._event is not None
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._event.clear()
                await self._event.wait()
                continue
            # let the batch fill: up to max_wait after the oldest request arrived or the worker became free,
            # whichever is later (under load, the clients answered by the last batch are about to come back)
            wait = self.max_wait_s
            if self.fill == "in_system" and self._last_batch_s:  # waiting for stragglers costs at most half a pass
                wait = min(wait, STRAGGLER_WAIT * self._last_batch_s)
            deadline = max(self._queue[0].enqueued, self._free_since) + wait
            # no point waiting for more inputs than recent batches held: a lone client is not made to wait
            recent = max(self._recent, default=self.max_batch)
            target = min(self.max_batch, max(recent, self._cycle_peak) if self.fill == "in_system" else recent)
            while self._depth < target and not self._closing:
                timeout = deadline - time.perf_counter()
                if timeout <= 0:
                    break
                self._event.clear()
                # a timer that sets the event, not asyncio.wait_for: no task and no cancellation per wait
                timer = asyncio.get_running_loop().call_later(timeout, self._event.set)
                await self._event.wait()
                timer.cancel()
            if self._lone is not None:  # the lone request in the worker thread finishes first
                await asyncio.wait([self._lone])
            batch = self._take()
            if batch:
                try:
                    await self._run(batch)
                except Exception:  # never let the loop die: the server must stay ready
                    log.exception("batcher %s: unexpected error", self.name)
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(InternalError("internal error; the server log has the details"))
                    self._outcome(ran=False, server_fault=True)
                self._running_inputs = 0
                self._free_since = time.perf_counter()

    def _take(self) -> list[_Request]:
        """Pop whole requests while they fit in ``max_batch`` inputs (a bigger request goes alone, chunked)."""
        batch: list[_Request] = []
        n = 0
        while self._queue:
            r = self._queue[0]
            if r.future.done():  # cancelled by its client while waiting
                self._queue.popleft()
                self._set_depth(self._depth - len(r.items))
                continue
            if batch and n + len(r.items) > self.max_batch:
                break
            self._queue.popleft()
            self._set_depth(self._depth - len(r.items))
            batch.append(r)
            n += len(r.items)
        return batch

    def _call(self, items: list[Any]) -> list[Any]:
        """Worker thread: ``run`` in chunks of ``max_batch``; metrics per forward pass."""
        out: list[Any] = []
        for i in range(0, len(items), self.max_batch):
            chunk = items[i : i + self.max_batch]
            t0 = time.perf_counter()
            res = self._fn(chunk)
            dt = time.perf_counter() - t0
            if len(res) != len(chunk):
                raise RuntimeError(f"model {self.name!r} returned {len(res)} results for {len(chunk)} inputs")
            out.extend(res)
            self._last_batch_s = dt
            if self.metrics is not None:
                self.metrics.inference_duration.labels(self.name).observe(dt)
                self.metrics.batch_size.labels(self.name).observe(len(chunk))
        return out

    async def _run(self, batch: list[_Request]) -> None:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        if self.metrics is not None:
            for r in batch:
                self.metrics.queue_wait.labels(self.name).observe(start - r.enqueued)
        items = [x for r in batch for x in r.items]
        self._recent.append(max(len(items), self._cycle_peak) if self.fill == "in_system" else len(items))
        self._cycle_peak = self._depth + len(items)  # the next cycle starts with what is in the system now
        self._running_inputs = len(items)
        try:
            results = await loop.run_in_executor(self._executor, self._call, items)
        except Exception as e:
            fault = self._count_error(e, len(items))
            ran = False
            if len(batch) == 1:
                self._fail(batch[0], e)
            else:  # isolate the culprit: each request alone; only the ones that fail again get an error
                for r in batch:
                    if r.future.done():
                        continue
                    t0 = time.perf_counter()
                    try:
                        res = await loop.run_in_executor(self._executor, self._call, list(r.items))
                    except Exception as e2:
                        fault = self._count_error(e2, len(r.items)) or fault
                        self._fail(r, e2)
                    else:
                        ran = True
                        self._resolve(r, res, start, time.perf_counter() - t0, len(r.items))
            self._outcome(ran=ran, server_fault=fault)
            return
        self._outcome(ran=True, server_fault=False)
        elapsed = time.perf_counter() - start
        i = 0
        for r in batch:
            n = len(r.items)
            self._resolve(r, results[i : i + n], start, elapsed, len(items))
            i += n

    async def _run_lone(self, items: Sequence[Any]) -> BatchResult:
        """A lone request, straight to the worker thread (module docstring): the batch it would have been."""
        n = len(items)
        loop = asyncio.get_running_loop()
        self._recent.append(max(n, self._cycle_peak) if self.fill == "in_system" else n)
        self._cycle_peak = n
        self._running_inputs = n
        start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_wait.labels(self.name).observe(0.0)
        lone = self._lone = loop.run_in_executor(self._executor, self._call, list(items))
        lone.add_done_callback(self._lone_done)
        try:
            results = await asyncio.shield(lone)  # a request cancelled meanwhile leaves the pass to finish
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._outcome(ran=False, server_fault=self._count_error(e, n))
            raise _for_client(e) from e
        self._outcome(ran=True, server_fault=False)
        return BatchResult(results, 0.0, time.perf_counter() - start, n)

    def _lone_done(self, fut: asyncio.Future) -> None:
        """The lone request's pass ended (whether its request still waits or not): the worker is free."""
        self._lone = None
        self._running_inputs = 0
        self._free_since = time.perf_counter()
        if not fut.cancelled():
            fut.exception()  # retrieved here: a request that was cancelled meanwhile does not leave it unread

    def _count_error(self, e: BaseException, n: int) -> bool:
        """Log and count a failed forward pass; False for a client error (not the model's fault)."""
        if isinstance(e, ServiceError) and e.status < 500:
            return False
        log.error("model %s: batch of %d inputs failed: %r", self.name, n, e, exc_info=e)
        if self.metrics is not None:
            self.metrics.batch_errors.labels(self.name).inc()
        return True

    def _outcome(self, *, ran: bool, server_fault: bool) -> None:
        """Track failed batches in a row: ``ran`` = the model answered at least one request of the batch."""
        if ran:
            self.consecutive_failures = 0
            if not self.healthy:
                self._set_healthy(True)
        elif server_fault:
            self.consecutive_failures += 1
            if self.healthy and self.unhealthy_after and self.consecutive_failures >= self.unhealthy_after:
                self._set_healthy(False)

    def _set_healthy(self, healthy: bool) -> None:
        self.healthy = healthy
        if healthy:
            log.warning("model %s: a batch ran again: healthy", self.name)
        else:
            log.error("model %s: %d batches failed in a row: unhealthy", self.name, self.consecutive_failures)
        if self._on_health is not None:
            try:
                self._on_health(healthy)
            except Exception:  # a callback must not stop the batching loop
                log.exception("model %s: health callback failed", self.name)

    @staticmethod
    def _fail(r: _Request, e: BaseException) -> None:
        if not r.future.done():
            r.future.set_exception(_for_client(e))

    @staticmethod
    def _resolve(r: _Request, results: list[Any], start: float, inference_s: float, batch_size: int) -> None:
        if not r.future.done():
            r.future.set_result(BatchResult(list(results), start - r.enqueued, inference_s, batch_size))


def _for_client(e: BaseException) -> BaseException:
    """What a failed pass tells its request: a domain error as it is, anything else as 500 with the contract's body
    only (the cause stays in the server log)."""
    return e if isinstance(e, ServiceError) else InternalError("inference failed; the server log has the details")
