"""What a decode step's plan costs on the way to a worker, whole block tables against the tables as
changes (parallel.sequence_cache, engine/runtime/plan_deltas.py): pickled bytes per rank, and the
controller's (encode + pickle) and the worker's (unpickle + apply) time per plan, medians.

The plans are a steady decode: `--seqs` sequences at each context length, blocks of 16 tokens,
1 in 16 of them adding a block this step (each decoding sequence fills a block every 16 steps).
Built with the engine's StepPlan and pickled as the pipe pickles them (ForkingPickler).

    python benchmarks/engine/plan_bytes.py [--seqs 256] [--contexts 128 512 2048 8192]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info  # noqa: E402

BLOCK = 16


def _plan(mb_id: int, tables: list[list[int]]):
    from batchinfer.engine.step_plan import StepPlan

    n = len(tables)
    return StepPlan(mb_id, [1000 + i for i in range(n)], [1] * n,
                    [BLOCK * len(t) - 3 for t in tables], tables, list(range(n)),
                    [f"req-{i:06d}" for i in range(n)], [200] * n)


def measure(seqs: int, context: int, steps: int) -> dict:
    from multiprocessing.reduction import ForkingPickler

    from batchinfer.engine.runtime.plan_deltas import TableCache, TableEncoder

    blocks = context // BLOCK
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    ids = [f"req-{i:06d}" for i in range(seqs)]
    next_block = seqs * blocks

    def grow(step: int) -> None:
        nonlocal next_block
        for i in range(step % BLOCK, seqs, BLOCK):     # 1 in 16 fills a block
            tables[i].append(next_block)
            next_block += 1

    full_bytes, full_send, full_recv = [], [], []
    for step in range(steps):
        grow(step)
        plan = _plan(step, tables)
        start = time.perf_counter()
        blob = bytes(ForkingPickler.dumps(plan))
        full_send.append(time.perf_counter() - start)
        start = time.perf_counter()
        pickle.loads(blob)
        full_recv.append(time.perf_counter() - start)
        full_bytes.append(len(blob))
    encoder, cache = TableEncoder(), TableCache()
    cache.apply(pickle.loads(bytes(ForkingPickler.dumps(encoder.encode(_plan(-1, tables), ids)))))
    delta_bytes, delta_send, delta_recv = [], [], []
    for step in range(steps):
        grow(step)
        plan = _plan(step, tables)
        start = time.perf_counter()
        blob = bytes(ForkingPickler.dumps(encoder.encode(plan, ids)))
        delta_send.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = cache.apply(pickle.loads(blob))
        delta_recv.append(time.perf_counter() - start)
        delta_bytes.append(len(blob))
        if got.block_tables != tables:
            raise SystemExit(f"context {context}: the worker's tables differ from the plan's")
    med = statistics.median
    return {"context": context, "seqs": seqs,
            "whole_tables": {"bytes": int(med(full_bytes)),
                             "controller_ms": round(1e3 * med(full_send), 3),
                             "worker_ms": round(1e3 * med(full_recv), 3)},
            "as_changes": {"bytes": int(med(delta_bytes)),
                           "controller_ms": round(1e3 * med(delta_send), 3),
                           "worker_ms": round(1e3 * med(delta_recv), 3)},
            "bytes_ratio": round(med(delta_bytes) / med(full_bytes), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    emit({"host": host_info(),
          "results": [measure(args.seqs, c, args.steps) for c in args.contexts]})


if __name__ == "__main__":
    main()
