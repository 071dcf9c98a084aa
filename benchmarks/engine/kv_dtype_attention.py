"""Decode attention alone, one step of W-decode's shape, by KV cache dtype (cache.kv_cache_dtype).

128 sequences at `--context` tokens, SmolLM2-135M's heads (9 query / 3 kv heads of 64), 30 layers
each with its own cache (so the KV comes from DRAM, as in a real step), blocks laid out as a batch
decoding in lockstep allocates them. The dtypes alternate round by round; medians of the rounds.

    python benchmarks/engine/kv_dtype_attention.py --context 75 139

Prints one JSON object per context.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from batchinfer.engine.attention import AttentionMetadata, NativeCPUAttention
from batchinfer.engine.kernels import load_native_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_inputs(context: int, seqs: int, layers: int, block_size: int = 16, dtypes: dict = DTYPES):
    """Queries, per-layer caches of each of `dtypes` and the metadata of one decode step (also
    decode_floor.py's)."""
    per_seq = -(-context // block_size)
    tables = [[b * seqs + i for b in range(per_seq)] for i in range(seqs)]  # lockstep layout
    meta = AttentionMetadata.build([1] * seqs, [context] * seqs, tables, block_size, torch.device("cpu"))
    shape = (per_seq * seqs, 3, block_size, 64)
    caches = {name: [(torch.randn(shape).to(dt), torch.randn(shape).to(dt)) for _ in range(layers)]
              for name, dt in dtypes.items()}
    return torch.randn(seqs, 9, 64), caches, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[75, 139])
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if not load_native_kernels():
        raise SystemExit("the native kernels did not build")
    attention = NativeCPUAttention()
    for context in args.context:
        q, caches, meta = step_inputs(context, args.seqs, args.layers)
        times = {name: [] for name in DTYPES}
        for _ in range(args.rounds + 1):          # the first round warms up and is dropped
            for name, layers in caches.items():
                t0 = time.perf_counter()
                for k, v in layers:
                    attention.attend(q, k, v, meta, 0.125)
                times[name].append(time.perf_counter() - t0)
        kv_bytes = {name: 2 * args.layers * args.seqs * context * 3 * 64 * dt.itemsize
                    for name, dt in DTYPES.items()}
        out = {"context": context, "seqs": args.seqs, "layers": args.layers}
        for name, ts in times.items():
            median = statistics.median(ts[1:])
            out[name] = {"step_ms": round(median * 1e3, 2),
                         "kv_mb": round(kv_bytes[name] / 1e6, 1),
                         "gb_per_s": round(kv_bytes[name] / median / 1e9, 1),
                         "speedup_vs_float32": round(statistics.median(times["float32"][1:]) / median, 2)}
        emit(out, indent=None)


if __name__ == "__main__":
    main()
