"""Where a GPU step's time goes: W-decode at one concurrency under torch's profiler (CPU + CUDA).

Prints each step's forward time (the first steps mix prefill chunks with decodes, the rest are
decode-only) and the ops with the most self time on the GPU and on the host, so launch-bound
steps (host time >> GPU time) show as such.

    python benchmarks/engine/cuda_step_profile.py --model DIR --load-format dummy --n 512 [--cuda-graphs auto|on|off]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import (  # noqa: E402
    W_DECODE, add_model_arguments, emit, model_section, warm_engine)


def _top(events, attr: str, k: int) -> list[dict]:
    def self_us(e) -> float:  # torch < 2.4 calls the device total self_cuda_time_total
        return getattr(e, attr, None) or getattr(e, attr.replace("device", "cuda"), 0) or 0

    rows = sorted(events, key=self_us, reverse=True)[:k]
    return [{"op": e.key[:80], "calls": e.count, "self_ms": round(self_us(e) / 1e3, 2)} for e in rows]


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from batchinfer.engine.request import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=W_DECODE)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                    help="device.cuda_graphs (auto: the engine's default, on with Triton)")
    args = ap.parse_args()
    engine, prompts = warm_engine(args.workload, args.n, model=model_section(args), device=args.device,
                                  cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
                                  max_tokens=args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.drain_step_events()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    events = engine.drain_step_events()
    ops = prof.key_averages()
    emit({
        "n": args.n, "elapsed_s_profiled": round(elapsed, 3),
        "step_ms": [round(e["dur"] * 1e3, 1) for e in events],
        "step_forward_ms": [round(e["forward_s"] * 1e3, 1) for e in events],
        "step_sample_ms": [round(e["sample_s"] * 1e3, 1) for e in events],
        "top_device_ops": _top(ops, "self_device_time_total", args.top) if args.device == "cuda" else [],
        "top_host_ops": _top(ops, "self_cpu_time_total", args.top),
    })


if __name__ == "__main__":
    main()
