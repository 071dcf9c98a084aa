"""How close to the GEMM roofline can any engine get on W-decode on this host?

w_decode.py divides an engine's tok/s by a GEMM-only roofline (gemm_roofline.py). But decode
attention must also read every cached K/V once a step (56 GB over W-decode at 128 sequences,
fp32), and on a host without SMT the cores that read it are the ones doing the GEMMs, so that
read adds to the GEMM time. This script bounds the best fraction of the workload roofline that
an engine can reach here by timing, in one process and alternating round by round:

- the roofline's GEMMs: the decode step at --n rows and the prefill (RooflineSampler);
- the K/V of one decode step at the run's mean decode context, laid out as the engine lays it out
  (lockstep blocks, 30 layers, each its own cache, so it comes from DRAM), read by
  kv_stream_probe.cpp with the decode kernel's thread split and visiting order:
  `plain_read` (no arithmetic) and `exact_attention_fmas` (the group's FMAs per vector, the least
  arithmetic exact attention does on each K and V vector);
- the engine's own decode attention kernel on the same cache (`our_kernel`).

The best fraction of the workload roofline is gemm / (gemm + the run's K/V at that rate); of the
decode roofline (w_decode.py's first fraction, which leaves the prefill out), that tok/s over
n / decode step. Each is what an engine would reach if it did nothing else at all (no norms,
rotary, KV writes, LM-head argmax, sampling, scheduling or Python): an upper bound.

    python benchmarks/engine/decode_floor.py
    python benchmarks/engine/decode_floor.py --n 256 --rounds 9
    python benchmarks/engine/decode_floor.py --threads 1 --sweep-fmas 0 1 2 3 4 8  # FMAs vs a read

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import W_DECODE, emit, kv_bytes_per_token, w_decode_prompts  # noqa: E402


def load_probe():
    """Builds (once, cached by source hash) and imports kv_stream_probe.cpp."""
    from torch.utils.cpp_extension import load

    from batchinfer.engine.kernels import cache_root

    source = HERE / "kv_stream_probe.cpp"
    flags = ["-O3", "-march=native", "-fopenmp"]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    name = f"kv_stream_probe_{digest}"
    build_dir = cache_root() / "benchmarks" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source)], build_directory=str(build_dir),
                extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def workload_kv_bytes(prompt_lens: list[int], max_tokens: int, bytes_per_token: int) -> int:
    """K/V the decode steps read, all layers: decode step k (1 .. max_tokens - 1) of a request
    attends over its prompt and k generated tokens (w_decode.run_ours counts it the same way)."""
    steps = max_tokens - 1
    return bytes_per_token * sum(steps * p + steps * (steps + 1) // 2 for p in prompt_lens)


def main() -> None:
    from benchmarks.engine.gemm_roofline import RooflineSampler
    from benchmarks.engine.kv_dtype_attention import step_inputs
    from batchinfer.engine.attention import NativeCPUAttention
    from batchinfer.engine.build import model_source
    from batchinfer.engine.config import ModelConfig
    from batchinfer.engine.kernels import load_native_kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=W_DECODE)
    ap.add_argument("--n", type=int, default=128, help="concurrent sequences (W-decode: 128)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--sweep-fmas", type=int, nargs="*", default=[],
                    help="also time the probe at these FMA counts per vector (0-8)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load_native_kernels():
        raise SystemExit("the native kernels did not build")
    probe = load_probe()
    source = model_source(ModelConfig())
    arch = source.arch
    prompt_lens = [len(source.tokenizer.encode(p)) for p in w_decode_prompts(args.workload, args.n)]
    kv_bytes = workload_kv_bytes(prompt_lens, args.max_tokens, kv_bytes_per_token(arch, "float32"))
    # the mean context of a decode step over the run
    context = round(statistics.mean(prompt_lens) + args.max_tokens / 2)
    # kv_dtype_attention's step: lockstep blocks, SmolLM2-135M's heads (9 query / 3 kv of 64)
    q, caches, meta = step_inputs(context, args.n, arch.num_layers, dtypes={"float32": torch.float32})
    caches, tables = caches["float32"], meta.block_tables
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    group = arch.num_heads // arch.num_kv_heads
    step_bytes = 2 * arch.num_layers * args.n * context * arch.num_kv_heads * arch.head_dim * 4
    attention = NativeCPUAttention()
    roofline = RooflineSampler(arch, args.n)
    roofline.prefill_seconds(sum(prompt_lens))

    def our_kernel():
        for k, v in caches:
            attention.attend(q, k, v, meta, arch.head_dim ** -0.5)

    readers = {"plain_read": lambda: probe.kv_stream_probe(keys, values, tables, context, 0),
               "exact_attention_fmas": lambda: probe.kv_stream_probe(keys, values, tables, context, group),
               "our_kernel": our_kernel}
    for fmas in args.sweep_fmas:
        readers[f"probe_{fmas}_fmas"] = lambda fmas=fmas: probe.kv_stream_probe(keys, values, tables, context, fmas)
    times = {name: [] for name in readers}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # round 0 warms up and is dropped
            roofline.sample()
            for name, run in readers.items():
                t0 = time.perf_counter()
                run()
                if round_:
                    times[name].append(time.perf_counter() - t0)
    step_s = statistics.median(roofline.samples[1:])
    gemm_s = roofline.prefill_samples[0] + (args.max_tokens - 1) * step_s
    out = {"n": args.n, "max_tokens": args.max_tokens, "prompt_tokens": sum(prompt_lens),
           "mean_decode_context": context, "threads": torch.get_num_threads(),
           "decode_gemm_step_ms": round(step_s * 1e3, 2), "workload_gemm_s": round(gemm_s, 3),
           "decode_kv_read_gb": round(kv_bytes / 1e9, 2), "readers": {}}
    for name, ts in times.items():
        gbps = step_bytes / statistics.median(ts) / 1e9
        kv_s = kv_bytes / gbps / 1e9
        best_tps = args.n * args.max_tokens / (gemm_s + kv_s)
        out["readers"][name] = {"attention_step_ms": round(statistics.median(ts) * 1e3, 2),
                                "gb_per_s": round(gbps, 1), "run_kv_s": round(kv_s, 3),
                                "best_fraction_of_workload_roofline": round(gemm_s / (gemm_s + kv_s), 3),
                                "best_fraction_of_decode_roofline": round(best_tps * step_s / args.n, 3)}
    emit(out)


if __name__ == "__main__":
    main()
