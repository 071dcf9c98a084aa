"""The MLP's GEMMs with SiLU-and-mul fused into the gate/up kernel against the unfused ops:
SmolLM2's 30 layers' gate/up and down projections (each layer its own random weights, so they
stream from DRAM as in the engine), blocked AVX2 kernel, alternating the two ways call by call.

    python benchmarks/probes/mlp_fusion.py [--rows 128] [--pairs 40]

Unfused: blocked_linear (gate/up) -> silu_and_mul -> blocked_linear (down). Fused:
blocked_linear_silu_mul -> blocked_linear (down). Prints one JSON object: median milliseconds per
30-layer pass of each, and the median of the per-pair ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, time_once  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 576, 1536, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=40)
    args = ap.parse_args()

    from batchinfer.engine.model.fast_linear import blocked_kernel_available, to_blocked
    if not blocked_kernel_available():
        sys.exit("the blocked AVX2 kernel is unavailable on this machine")
    ops = torch.ops.batchinfer
    gen = torch.Generator().manual_seed(0)
    gate_up = [to_blocked(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5).contiguous()
               for _ in range(LAYERS)]
    down = [to_blocked(torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE ** 0.5).contiguous()
            for _ in range(LAYERS)]
    x = torch.randn(args.rows, HIDDEN, generator=gen)

    def unfused() -> None:
        for gu, dn in zip(gate_up, down):
            ops.blocked_linear(ops.silu_and_mul(ops.blocked_linear(x, gu)), dn)

    def fused() -> None:
        for gu, dn in zip(gate_up, down):
            ops.blocked_linear(ops.blocked_linear_silu_mul(x, gu), dn)

    unfused(), fused()                                    # warm-up
    pairs = []
    for i in range(args.pairs):
        if i % 2 == 0:
            a = time_once(unfused)
            b = time_once(fused)
        else:
            b = time_once(fused)
            a = time_once(unfused)
        pairs.append((a, b))
    emit({
        "rows": args.rows, "layers": LAYERS, "pairs": args.pairs, "threads": torch.get_num_threads(),
        "unfused_ms": round(statistics.median(a for a, _ in pairs) * 1e3, 2),
        "fused_ms": round(statistics.median(b for _, b in pairs) * 1e3, 2),
        "unfused_over_fused_median": round(statistics.median(a / b for a, b in pairs), 3),
    }, indent=None)


if __name__ == "__main__":
    main()
