"""What a tensor-parallel all-reduce costs on this machine next to the GEMMs it follows.

Two processes (one thread each, as TP=2 runs on 2 cores) all-reduce [rows, 576] fp32 tensors over
gloo and through shared memory (engine/runtime/shm_allreduce.py, what the TP layouts use on CPU
unless `parallel.tp_all_reduce: gloo`; NCCL on CUDA) and time one rank's half of a decoder layer's
GEMMs at the same row count (SmolLM2 shape: qkv + o + gate/up + down, split by 2). A TP layer
does two all-reduces; rows = 11 is a decode step of a KV-bound long-context batch, 128 a
ShareGPT-like decode batch, 2048 a prefill micro-batch.

    python benchmarks/engine/allreduce_cost.py

Prints one JSON object.
"""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402

ROWS = (11, 128, 2048)
HIDDEN, Q, KV, INTER = 576, 512, 256, 1536


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, queue, buffer) -> None:
    from batchinfer.engine.kernels import load_native_kernels
    from batchinfer.engine.runtime.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    shm = ShmAllReduce(buffer, rank, 2, timeout_s=60) if load_native_kernels() else None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    # one TP rank's weights of a layer: qkv and gate/up column halves, o and down row halves
    shapes = [(HIDDEN, (Q + 2 * KV) // 2), (Q // 2, HIDDEN), (HIDDEN, INTER), (INTER // 2, HIDDEN)]
    weights = [torch.randn(*s) for s in shapes]
    out = []
    for rows in ROWS:
        t = torch.randn(rows, HIDDEN)
        for _ in range(5):
            dist.all_reduce(t)
        n = 50 if rows > 500 else 500
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        ar = (time.perf_counter() - t0) / n
        shm_ar = None
        if shm is not None:
            for _ in range(5):
                shm.all_reduce(t)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                shm.all_reduce(t)
            shm_ar = (time.perf_counter() - t0) / n
        xs = [torch.randn(rows, w.shape[0]) for w in weights]
        for x, w in zip(xs, weights):    # warm-up
            x @ w
        t0 = time.perf_counter()
        for _ in range(5):
            for x, w in zip(xs, weights):
                x @ w
        gemm = (time.perf_counter() - t0) / 5
        out.append({"rows": rows, "all_reduce_ms": round(ar * 1e3, 3),
                    "all_reduce_GB_per_s": round(t.numel() * 4 / ar / 1e9, 3),
                    "half_layer_gemm_ms": round(gemm * 1e3, 3),
                    "two_all_reduces_per_layer_vs_gemm": round(2 * ar / gemm, 3),
                    "shm_all_reduce_ms": None if shm_ar is None else round(shm_ar * 1e3, 4),
                    "shm_two_all_reduces_per_layer_vs_gemm":
                        None if shm_ar is None else round(2 * shm_ar / gemm, 4)})
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    from batchinfer.engine.kernels import load_native_kernels
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.engine.runtime.shm_allreduce import group_buffers

    load_native_kernels()   # built once here, not by both ranks at once
    buffer = group_buffers([ParallelLayout(2, 1, 1, (30,))], "cpu", "shm").get((0, 1))
    procs = [ctx.Process(target=_rank, args=(r, port, queue, buffer)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    emit({"backends": ["gloo", "shm"], "threads_per_rank": 1, "results": result})


if __name__ == "__main__":
    main()
