"""Where a W-decode run's time goes: GEMMs, attention, the other ops, and what is left (Python).

The roofline w_decode.py divides by counts only the GEMMs, so everything else in a step is the
gap between the engine and it. This runs W-decode (128 prompts, --max-tokens tokens each, greedy,
ignore_eos, SmolLM2-135M fp32, all cores) once under torch's profiler, sums each op's own time
over the run and groups the ops: `gemm` (the linears, whichever kernel), `attention` (paged
attention), `other_ops` (norms, rotary, KV writes, SiLU, argmax, embedding, ...). `outside_ops`
is the run's wall time minus all op time: Python, the controller, and the profiler's own cost
(so it reads high). Decode steps slow down as their context grows (attention reads every cached
token), so the first and last eight decode steps' median durations are given too.

    python benchmarks/engine/step_breakdown.py
    python benchmarks/engine/step_breakdown.py --kv-cache-dtype bfloat16

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import W_DECODE, emit, warm_engine  # noqa: E402

GEMM_OPS = ("mkldnn::_linear_pointwise", "batchinfer::blocked_linear", "batchinfer::blocked_linear_silu_mul",
            "batchinfer::bf16_linear", "batchinfer::bf16_linear_silu_mul", "batchinfer::amx_linear",
            "batchinfer::amx_linear_silu_mul", "batchinfer::int8_linear",
            "aten::addmm", "aten::mm", "aten::linear")
ATTENTION_OPS = ("batchinfer::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def group_of(op: str) -> str:
    if op in GEMM_OPS:
        return "gemm"
    return "attention" if op in ATTENTION_OPS else "other_ops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=W_DECODE)
    ap.add_argument("--n", type=int, default=128, help="requests (the prompts repeat past 128)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16"])
    args = ap.parse_args()

    import torch
    from batchinfer.engine.request import SamplingParams

    engine, prompts = warm_engine(args.workload, args.n,
                                  kv_cache_dtype=args.kv_cache_dtype)
    engine.drain_step_events()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    events = engine.drain_step_events()
    op_seconds = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    groups = {"gemm": 0.0, "attention": 0.0, "other_ops": 0.0}
    for op, seconds in op_seconds.items():
        groups[group_of(op)] += seconds
    groups["outside_ops"] = max(0.0, wall - sum(groups.values()))
    decode = [e["dur"] for e in events if e["num_prefill_tokens"] == 0]
    tokens = sum(o.num_output_tokens for o in outs)
    emit({
        "requests": len(outs), "output_tokens": tokens, "steps": len(events), "wall_s": round(wall, 3),
        "output_tok_per_s_profiled": round(tokens / wall, 1), "kv_cache_dtype": engine.info["kv_cache_dtype"],
        "linear_kernel": engine.info.get("linear_kernel"),
        "seconds": {k: round(v, 3) for k, v in groups.items()},
        "share": {k: round(v / wall, 3) for k, v in groups.items()},
        "decode_step_ms": ({"first_8_median": round(statistics.median(decode[:8]) * 1e3, 1),
                            "last_8_median": round(statistics.median(decode[-8:]) * 1e3, 1)}
                           if decode else None),
        "top_ops_s": {k: round(v, 3) for k, v in sorted(op_seconds.items(), key=lambda kv: -kv[1])[:10]},
    })


if __name__ == "__main__":
    main()
