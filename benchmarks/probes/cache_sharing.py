"""Do two cores share a last-level cache? Whether SiDP's replicas could read one layer's shared
FFN weights once between them by running in step (the second reader hitting the cache).

Two processes pinned to two cores: the first reads a buffer in shared memory (twice, so it sits
in that core's caches), then the second reads it and, for comparison, a buffer nobody touched
lately, and then the first buffer again (now in its own caches: what a hit looks like). If the
cores share a last-level cache, the read after the other core's is close to that, well above cold.

    python benchmarks/probes/cache_sharing.py --mb 8 --rounds 40

Prints one JSON object: the median read bandwidth of each kind, in GB/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402

BUFFERS = 16


def _reader(rank: int, cpu: int, buffers, flags, rounds: int, queue) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    other = 1 - rank
    warm, cold, again = [], [], []
    for turn in range(1, rounds + 1):
        shared = buffers[turn % BUFFERS]
        if rank == 0:
            shared.sum()
            shared.sum()
            flags[rank] = turn
            while flags[other] < turn:
                pass
            continue
        while flags[other] < turn:
            pass
        start = time.perf_counter()
        shared.sum()
        warm.append(time.perf_counter() - start)
        start = time.perf_counter()
        shared.sum()
        again.append(time.perf_counter() - start)
        start = time.perf_counter()
        buffers[(turn + BUFFERS // 2) % BUFFERS].sum()
        cold.append(time.perf_counter() - start)
        flags[rank] = turn
    if rank == 1:
        queue.put([statistics.median(times) for times in (warm, cold, again)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="buffer size (one FFN layer: ~10 MB)")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("cache_sharing.py needs two CPUs")
    numel = int(args.mb * 2**20) // 4
    buffers = [torch.randn(numel).share_memory_() for _ in range(BUFFERS)]
    flags = torch.zeros(2, dtype=torch.int64).share_memory_()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(rank, cpus[rank], buffers, flags, args.rounds, queue))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    warm_s, cold_s, again_s = queue.get()
    for proc in procs:
        proc.join()
    gb = args.mb / 1024
    emit({"cpus": cpus[:2], "mb": args.mb,
          "after_other_core_gb_per_s": round(gb / warm_s, 1),
          "cold_gb_per_s": round(gb / cold_s, 1),
          "own_cache_gb_per_s": round(gb / again_s, 1),
          "shared_last_level_cache": gb / warm_s > 1.5 * gb / cold_s}, indent=None)


if __name__ == "__main__":
    main()
