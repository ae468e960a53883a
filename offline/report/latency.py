"""Latency of one call, as the report's rows give it: ``{"min_ms", "median_ms", "reps"}``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def measure_latency(fn: Callable[[], Any], warmup: int = 2, reps: int = 5) -> dict:
    """Wall-clock time of ``fn()`` under ``torch.inference_mode``: ``{"min_ms", "median_ms", "reps"}``.

    ``warmup`` untimed calls first (allocator, oneDNN kernel selection), then ``reps`` timed ones.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"min_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3), "reps": reps}
