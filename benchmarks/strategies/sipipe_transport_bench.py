"""Structure-aware vs structure-unaware hidden-state transport between two pipeline stages
(SiPipe §5.3, Fig. 7), measured on gloo (CPU) with engine/runtime/stage_transport.py.

Two ranks (one thread each). Per step, rank 0 "computes" (a real [T, H] x [H, H] matmul, repeated
so a step costs ~--target-ms) and sends {"hidden", "residual"} [T, H] to rank 1; it reaps finished
sends as the worker does. Rank 1 gets the plan for step s+1 when it starts step s's compute (one
step ahead, like the worker: `post` then), waits for step s's data, then computes on it. Reported
per (tokens, protocol): medians over --steps steps after --warmup of the receiver's time blocked in
wait(), the sender's time blocked in send() (and reaping in-flight sends), each rank's compute and
the receiver's step time (the pipeline's output rate), plus the metadata/tensor message counts.

    python benchmarks/strategies/sipipe_transport_bench.py [--steps 200] [--hidden 576] [--tokens 16 256]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402

MAX_PENDING_SENDS = 8       # as engine/runtime/worker.py


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


def _calibrate(tokens: int, hidden: int, target_ms: float) -> int:
    """Matmul repetitions per step for ~target_ms of compute (rank 0 measures, both use it)."""
    reps = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == 0:
        x, w = torch.randn(tokens, hidden), torch.randn(hidden, hidden)
        for _ in range(3):
            x @ w
        t0 = time.perf_counter()
        for _ in range(20):
            x @ w
        per_ms = (time.perf_counter() - t0) / 20 * 1e3
        reps[0] = max(1, round(target_ms / per_ms))
    dist.broadcast(reps, src=0)
    return int(reps[0])


def _compute(x: torch.Tensor, w: torch.Tensor, reps: int) -> torch.Tensor:
    for _ in range(reps):
        y = x @ w
    return y


def _sender(tokens: int, hidden: int, reps: int, n: int, warmup: int, aware: bool) -> dict:
    from batchinfer.engine.runtime.stage_transport import StageSender

    sender = StageSender(1, torch.device("cpu"), structure_aware=aware)
    x = torch.randn(tokens, hidden)
    w = torch.randn(hidden, hidden) / hidden ** 0.5
    inflight: deque = deque()
    compute, send, reap = [], [], []
    for step in range(n):
        t0 = time.perf_counter()
        h = _compute(x, w, reps)
        t1 = time.perf_counter()
        inflight.append(sender.send(step, {"hidden": h, "residual": x}))
        t2 = time.perf_counter()
        while inflight and (len(inflight) > MAX_PENDING_SENDS
                            or all(work.is_completed() for work in inflight[0])):
            for work in inflight.popleft():
                work.wait()
        t3 = time.perf_counter()
        if step >= warmup:
            compute.append(t1 - t0)
            send.append(t2 - t1)
            reap.append(t3 - t2)
    while inflight:
        for work in inflight.popleft():
            work.wait()
    c = sender.counters
    return {"sender_compute_ms": _ms(compute), "sender_send_ms": _ms(send),
            "sender_reap_ms": _ms(reap),
            "sender_metadata_messages": c.metadata_messages,
            "sender_tensor_messages": c.tensor_messages}


def _receiver(tokens: int, hidden: int, reps: int, n: int, warmup: int, aware: bool) -> dict:
    from batchinfer.engine.runtime.stage_transport import StageReceiver

    receiver = StageReceiver(0, torch.device("cpu"), structure_aware=aware)
    w = torch.randn(hidden, hidden) / hidden ** 0.5
    handle = receiver.post(0, tokens)
    wait, compute, starts = [], [], []
    for step in range(n):
        t0 = time.perf_counter()
        got = handle.wait()
        t1 = time.perf_counter()
        if step + 1 < n:
            handle = receiver.post(step + 1, tokens)     # the next plan arrives now
        _compute(got["hidden"], w, reps)
        t2 = time.perf_counter()
        starts.append(t0)
        if step >= warmup:
            wait.append(t1 - t0)
            compute.append(t2 - t1)
    starts.append(time.perf_counter())
    steps = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1:])]
    c = receiver.counters
    return {"receiver_wait_ms": _ms(wait), "receiver_compute_ms": _ms(compute),
            "step_ms": _ms(steps), "mean_step_ms": round(sum(steps) / len(steps) * 1e3, 4),
            "receiver_metadata_messages": c.metadata_messages,
            "receiver_tensor_messages": c.tensor_messages}


def _rank(rank: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    n = args.warmup + args.steps
    try:
        for tokens in args.tokens:
            reps = _calibrate(tokens, args.hidden, args.target_ms)
            for aware in (True, False):
                dist.barrier()
                run = _sender if rank == 0 else _receiver
                out = run(tokens, args.hidden, reps, n, args.warmup, aware)
                queue.put((rank, tokens, aware, reps, out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--target-ms", type=float, default=3.0,
                        help="compute per step and rank (matmul repetitions are calibrated)")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    merged: dict = {}
    for _ in range(2 * 2 * len(args.tokens)):
        rank, tokens, aware, reps, out = queue.get(timeout=300)
        row = merged.setdefault((tokens, aware), {
            "tokens": tokens, "protocol": "structure_aware" if aware else "structure_unaware",
            "matmul_reps": reps})
        row.update(out)
    for p in procs:
        p.join()
    results = [merged[key] for key in sorted(merged, key=lambda k: (k[0], not k[1]))]
    emit({"backend": "gloo", "device": "cpu", "threads_per_rank": 1,
          "torch": torch.__version__, "hidden": args.hidden, "steps": args.steps,
          "warmup": args.warmup, "target_compute_ms": args.target_ms, "results": results})


if __name__ == "__main__":
    main()
