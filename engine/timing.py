"""Median wall time of a callable: the one way startup profiles and benchmarks time a piece of
work on a noisy machine."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """One warm-up call (allocator, kernel selection, caches), then the median of `repeats`."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
