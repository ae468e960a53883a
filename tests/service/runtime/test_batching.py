"""The dynamic batcher on its own: batch formation, bounded queue, failure isolation, draining on close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from service.core.errors import InternalError, NotReady, Overloaded
from service.metrics import Metrics
from service.runtime.batching import Batcher, BatchLimits


def run(coro):
    return asyncio.run(coro)


def held() -> tuple[threading.Event, Callable[[list], list]]:
    """``(gate, fn)``: a batch function that holds every batch until ``gate`` is set (at most 5 s), then echoes it."""
    gate = threading.Event()

    def fn(items: list) -> list:
        gate.wait(5)
        return list(items)

    return gate, fn


def started(fn: Callable[[list], list], **limits: float) -> Batcher:
    """A running batcher of model ``m`` around ``fn`` with ``limits`` (max_batch, max_wait_s, max_queue)."""
    b = Batcher("m", fn, BatchLimits(**limits))
    b.start()
    return b


def test_requests_are_batched_up_to_max_batch():
    calls: list[list[int]] = []

    def square(items):
        calls.append(list(items))
        return [x * x for x in items]

    async def main():
        b = Batcher("m", square, BatchLimits(max_batch=4, max_wait_s=0.2, max_queue=100))
        b.start()
        res = await asyncio.gather(*(b.submit([i]) for i in range(10)))
        await b.close()
        return res

    res = run(main())
    assert [r.results for r in res] == [[i * i] for i in range(10)]
    assert [len(c) for c in calls] == [4, 4, 2]  # full batches at once; the rest after max_wait
    assert sorted(x for c in calls for x in c) == list(range(10))
    assert all(r.batch_size in (4, 2) for r in res)


def test_max_wait_bounds_the_wait_of_a_lonely_request():
    async def main():
        b = Batcher("m", lambda xs: xs, BatchLimits(max_batch=64, max_wait_s=0.05, max_queue=100))
        b.start()
        t0 = time.perf_counter()
        r = await b.submit(["x"])
        dt = time.perf_counter() - t0
        await b.close()
        return r, dt

    r, dt = run(main())
    assert r.results == ["x"] and r.batch_size == 1
    assert 0.04 <= r.queue_s and dt < 2.0


def test_big_request_runs_in_chunks_of_max_batch():
    sizes = []

    def ident(items):
        sizes.append(len(items))
        return list(items)

    async def main():
        b = Batcher("m", ident, BatchLimits(max_batch=3, max_wait_s=0.0, max_queue=100))
        b.start()
        r = await b.submit(list(range(8)))
        await b.close()
        return r

    assert run(main()).results == list(range(8))
    assert sizes == [3, 3, 2]


def test_full_queue_answers_overloaded_with_retry_after():
    gate, blocked = held()

    async def main():
        b = started(blocked, max_batch=2, max_wait_s=0.0, max_queue=3)
        first = asyncio.ensure_future(b.submit([1, 2]))  # taken into a batch, blocks the worker
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(b.submit([3, 4, 5]))  # fills the queue (3 inputs)
        await asyncio.sleep(0.01)
        assert b.depth == 3
        with pytest.raises(Overloaded) as e:
            await b.submit([6])
        gate.set()
        out = [(await first).results, (await queued).results]
        await b.close()
        return e.value, out

    err, out = run(main())
    assert err.status == 503 and err.code == "overloaded" and int(err.headers["Retry-After"]) >= 1
    assert "HYDRA_MAX_QUEUE" in err.message
    assert out == [[1, 2], [3, 4, 5]]


def test_a_failing_input_fails_only_its_own_request():
    calls = []

    def picky(items):
        calls.append(list(items))
        if "poison" in items:
            raise RuntimeError("secret internals")
        return [s.upper() for s in items]

    async def main():
        m = Metrics()
        b = Batcher("m", picky, BatchLimits(max_batch=8, max_wait_s=0.1, max_queue=100), metrics=m)
        b.start()
        res = await asyncio.gather(b.submit(["a"]), b.submit(["poison"]), b.submit(["b", "c"]), return_exceptions=True)
        after = await b.submit(["d"])  # still serving
        await b.close()
        return res, after, m

    (ra, rp, rbc), after, m = run(main())
    assert ra.results == ["A"] and rbc.results == ["B", "C"] and after.results == ["D"]
    assert isinstance(rp, InternalError) and rp.status == 500 and "secret" not in rp.message
    assert calls[0] == ["a", "poison", "b", "c"]  # tried together first, then one request at a time
    assert ["poison"] in calls[1:] and ["a"] in calls[1:]
    # the batch, then the poison request alone
    assert m.registry.get_sample_value("hydra_batch_errors_total", {"model": "m"}) == 2


def test_close_finishes_queued_requests_then_refuses():
    gate, slow = held()

    async def main():
        b = started(slow, max_batch=1, max_wait_s=0.0, max_queue=10)
        pending = [asyncio.ensure_future(b.submit([i])) for i in range(3)]
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(b.close())
        await asyncio.sleep(0.01)
        with pytest.raises(NotReady):
            await b.submit([99])
        gate.set()
        await closing
        return [(await p).results for p in pending]

    assert run(main()) == [[0], [1], [2]]


def test_cancelled_request_is_skipped():
    seen = []

    def record(items):
        seen.extend(items)
        return list(items)

    async def main():
        b = Batcher("m", record, BatchLimits(max_batch=8, max_wait_s=0.1, max_queue=10))
        b.start()
        doomed = asyncio.ensure_future(b.submit(["gone"]))
        kept = asyncio.ensure_future(b.submit(["kept"]))
        await asyncio.sleep(0.01)
        doomed.cancel()
        r = await kept
        await b.close()
        return r, b.depth

    r, depth = run(main())
    assert r.results == ["kept"] and seen == ["kept"] and depth == 0


@pytest.mark.parametrize(("fill", "lo", "hi"), [("in_system", 7.0, 8.0), ("recent", 3.5, 4.5)])
def test_medium_load_fills_batches_with_the_clients_in_flight(fill, lo, hi):
    """8 closed-loop clients that start as two groups of 4 (one group's batch runs while the other queues).
    ``recent`` keeps that split for good: each queued group already reaches the largest recent batch (4).
    ``in_system`` sees 8 inputs in flight and waits (at most max_wait) for the group just answered: batches of 8
    after the first cycles."""
    sizes: list[int] = []

    def model(items: list) -> list:
        sizes.append(len(items))
        time.sleep(0.03)  # a forward pass
        return list(items)

    async def client(b: Batcher, rounds: int) -> None:
        for _ in range(rounds):
            await b.submit(["x"])

    async def main() -> None:
        b = Batcher("m", model, BatchLimits(max_batch=32, max_wait_s=0.1, max_queue=100, fill=fill))
        b.start()
        first = [asyncio.create_task(client(b, 12)) for _ in range(4)]
        await asyncio.sleep(0.005)
        while not sizes:  # the first group's batch is running: the second group queues behind it
            await asyncio.sleep(0.001)
        second = [asyncio.create_task(client(b, 12)) for _ in range(4)]
        await asyncio.gather(*first, *second)
        await b.close()

    run(main())
    steady = sizes[4:-2]  # after the first cycles, before the clients finish
    assert lo <= sum(steady) / len(steady) <= hi, sizes


def test_fill_rule_is_checked():
    with pytest.raises(ValueError, match="fill must be one of"):
        Batcher("m", lambda xs: xs, BatchLimits(max_batch=4, max_wait_s=0.01, max_queue=10, fill="greedy"))


def test_a_lone_request_goes_to_the_worker_at_once_and_a_crowd_is_batched():
    """With the server's in-flight count: alone, a request goes to the worker thread at once (no queue wait, never
    on the event loop's thread); with other requests in flight, it queues and batches as before; an error alone is
    the request's."""
    in_flight = [1]
    threads: list[str] = []

    def run(items):
        threads.append(threading.current_thread().name)
        if "bad" in items:
            raise ValueError("bad input")
        return [x * 2 for x in items]

    async def main():
        b = Batcher("m", run, BatchLimits(4, 0.05, 64), in_flight=lambda: in_flight[0])
        b.start()
        alone = await b.submit([1, 2])
        assert alone.results == [2, 4] and alone.queue_s == 0.0 and alone.batch_size == 2
        assert threads == ["hydra-m_0"] and b._lone is None and b._running_inputs == 0
        with pytest.raises(InternalError):
            await b.submit(["bad"])
        in_flight[0] = 5  # a crowd: through the queue and the worker thread, in batches
        res = await asyncio.gather(*(b.submit([i]) for i in range(4)))
        assert [r.results for r in res] == [[2 * i] for i in range(4)] and res[0].batch_size == 4
        assert threads[-1].startswith("hydra-m")
        await b.close()

    asyncio.run(main())


def test_requests_behind_a_lone_one_wait_for_it_then_batch():
    """A lone request in the worker thread, then a crowd: the crowd's batch starts once the lone pass is done (one
    pass at a time), and a lone request whose client went away leaves the worker free after its pass."""
    gate = threading.Event()
    calls: list[list[int]] = []
    in_flight = [1]

    def run(items):
        calls.append(list(items))
        if items == [0]:
            gate.wait(5)
        return items

    async def main():
        b = Batcher("m", run, BatchLimits(8, 0.01, 64), in_flight=lambda: in_flight[0])
        b.start()
        lone = asyncio.ensure_future(b.submit([0]))
        await asyncio.sleep(0.05)
        in_flight[0] = 4
        crowd = asyncio.gather(*(b.submit([i]) for i in (1, 2, 3)))
        await asyncio.sleep(0.05)
        assert calls == [[0]]  # the crowd waits for the lone pass
        lone.cancel()  # its client went away: the pass still ends, and frees the worker
        gate.set()
        assert [r.results for r in await crowd] == [[1], [2], [3]]
        assert calls == [[0], [1, 2, 3]] and b._lone is None
        await b.close()

    asyncio.run(main())
