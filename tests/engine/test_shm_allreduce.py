"""The shared-memory tensor-parallel all-reduce: sums, identical bits on every rank, chunking, and
back-to-back calls with ranks arriving at different times (the double-buffered slots)."""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.multiprocessing as mp

from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.runtime.shm_allreduce import COUNTER_FLOATS, ShmAllReduce

pytestmark = pytest.mark.skipif(not load_native_kernels(), reason="native kernels did not build")

SIZES = [1, 7, 576 * 11, 3000, 1024 * 5 + 3]  # the last ones span several 1024-float slots


def _inputs(rank: int, call: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * call + rank))


def _rank(rank: int, world: int, buffer: torch.Tensor, calls: int, queue) -> None:
    torch.set_num_threads(1)
    import batchinfer.engine.kernels as kernels

    kernels.load_native_kernels()
    reducer = ShmAllReduce(buffer, rank, world, timeout_s=60)
    rnd = random.Random(rank)
    results = []
    for call in range(calls):
        if rnd.random() < 0.3:           # arrive late: the others must wait, not read stale slots
            time.sleep(rnd.random() * 0.003)
        t = _inputs(rank, call, SIZES[call % len(SIZES)])
        results.append(reducer.all_reduce(t).numpy().copy())  # by value: the process exits next
    queue.put((rank, results, reducer.generation))


def _run(world: int, slot: int, calls: int):
    buffer = torch.zeros(world * COUNTER_FLOATS + 2 * world * slot).share_memory_()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, buffer, calls, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120)[:2] for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_sums_match_and_every_rank_gets_the_same_bits(world):
    calls = 60
    out = _run(world, slot=1024, calls=calls)
    for call in range(calls):
        n = SIZES[call % len(SIZES)]
        expected = sum(_inputs(r, call, n) for r in range(world))
        torch.testing.assert_close(torch.from_numpy(out[0][call]), expected, rtol=1e-6, atol=1e-6)
        for r in range(1, world):
            assert out[r][call].tobytes() == out[0][call].tobytes(), (call, r)


def test_a_missing_peer_times_out_with_a_clear_error():
    buffer = torch.zeros(2 * COUNTER_FLOATS + 4 * 1024)
    reducer = ShmAllReduce(buffer, 0, 2, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="did not reach call 1"):
        reducer.all_reduce(torch.ones(10))
