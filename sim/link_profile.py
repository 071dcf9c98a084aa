"""Point-to-point and all-reduce cost between two ranks, measured with torch.distributed.

Two spawned processes (gloo on CPU, one thread each; NCCL on two GPUs when the machine has them)
rendezvous through a TCPStore on a port the OS picks. For each message size: a ping-pong
(half the round trip is one p2p transfer) and an all-reduce the way the engine's TP groups do it
(on CPU through shared memory unless `parallel.tp_all_reduce: gloo`), medians of repeated runs; then
`seconds = latency + bytes / bandwidth` is fitted over the sizes (least squares, both >= 0).
"""
from __future__ import annotations

import datetime
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
QUICK_SIZES = (1 << 10, 1 << 16, 1 << 20)
TIMEOUT = datetime.timedelta(seconds=300)


def _rank_main(rank: int, port: int, device_type: str, sizes, repeats: int, queue,
               shm_buffer=None) -> None:
    try:
        _measure(rank, port, device_type, sizes, repeats, queue, shm_buffer)
    except BaseException as exc:  # noqa: BLE001 - reported, so the profiler fails instead of waiting
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def _measure(rank: int, port: int, device_type: str, sizes, repeats: int, queue, shm_buffer) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    shm = None
    if shm_buffer is not None:
        from batchinfer.engine.runtime.shm_allreduce import ShmAllReduce

        shm = ShmAllReduce(shm_buffer, rank, 2, TIMEOUT.total_seconds())
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    try:
        rows = []
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
            p2p, allreduce = [], []
            for i in range(repeats + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                if shm is not None:
                    shm.all_reduce(buf)
                else:
                    dist.all_reduce(buf)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t2 = time.perf_counter()
                if i >= 2:                                   # warm-up rounds
                    p2p.append((t1 - t0) / 2)
                    allreduce.append(t2 - t1)
            rows.append((buf.numel() * 4, statistics.median(p2p), statistics.median(allreduce)))
        if rank == 0:
            queue.put(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fit_link(sizes: list[int], seconds: list[float]) -> dict:
    """latency + bytes / bandwidth, both non-negative."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds), 1)
    if slope <= 0:     # flat: all latency; charge the largest size's rate as bandwidth
        slope = max(seconds) / max(sizes)
    return {"latency_s": max(float(intercept), 0.0), "bytes_per_s": float(1.0 / slope)}


def profile_links(device_type: str = "cpu", quick: bool = False, repeats: int = 10,
                  tp_all_reduce: str = "shm") -> dict:
    """-> {"p2p": {latency_s, bytes_per_s}, "allreduce": {latency_s, bytes_per_s, ranks: 2},
    "points": [[bytes, p2p_s, allreduce_s], ...], "backend", "allreduce_backend"}.
    tp_all_reduce: the recipe's parallel.tp_all_reduce."""
    from batchinfer.engine.cpu_binding import unpinned
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.engine.runtime.shm_allreduce import group_buffers, resolve_mode

    if device_type == "cuda" and torch.cuda.device_count() < 2:
        device_type = "cpu"          # one GPU: nothing to link; the host path is what exists
    pair = ParallelLayout(tp=2, pp=1, dp=1, layers_per_stage=(1,))
    shm_buffer = group_buffers([pair], device_type, tp_all_reduce).get((0, 1))
    sizes = QUICK_SIZES if quick else SIZES
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, device_type, sizes,
                                                  3 if quick else repeats, queue, shm_buffer),
                         daemon=True)
             for r in range(2)]
    with unpinned():
        for proc in procs:
            proc.start()
    try:
        rows = queue.get(timeout=TIMEOUT.total_seconds())
        if rows and rows[0] == "error":
            raise RuntimeError(f"link profile: rank {rows[1]} failed: {rows[2]}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    nbytes = [r[0] for r in rows]
    return {"p2p": fit_link(nbytes, [r[1] for r in rows]),
            "allreduce": {**fit_link(nbytes, [r[2] for r in rows]), "ranks": 2},
            "points": [list(r) for r in rows], "backend": "nccl" if device_type == "cuda" else "gloo",
            "allreduce_backend": resolve_mode(device_type, tp_all_reduce)}
