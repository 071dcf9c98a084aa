"""One mixture-of-experts layer's experts on a GPU: the grouped Triton kernels (engine/triton_moe.py,
the CUDA default) against the per-expert torch path (`device.moe_kernel: torch`), at Qwen3-30B-A3B's
expert shapes by default (128 experts of 768 rows over hidden 2,048, top 8, bf16).

    python benchmarks/engine/moe_kernel_bench.py [--tokens 1 16 64 256 1024 4096] [--repeats 20]
    python benchmarks/engine/moe_kernel_bench.py --device cpu --tiny     # the code path, in
                                                                         # Triton's interpreter

For each token count: the median time of a layer's experts each way (CUDA events, after a
warm-up), the experts the routing touched, and the bytes of their weights over the Triton
kernels' time (a decode step reads each touched expert's weights once: the bound at small
batches). Prints one JSON object with the card's name.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402


def _timed(fn, device, repeats: int) -> float:
    """Median seconds of fn(): CUDA events on a GPU (gpu_engine_bench's), else the wall clock."""
    if device.type == "cuda":
        from benchmarks.engine.gpu_engine_bench import _cuda_time

        return _cuda_time(fn, repeats)
    from batchinfer.engine.timing import median_seconds

    return median_seconds(fn, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="8 experts of 32 rows over 64, 1 and 20 tokens, 2 repeats (a smoke test)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported
    if args.tiny:
        args.experts, args.top_k, args.hidden, args.rows = 8, 2, 64, 32
        args.tokens, args.repeats = [1, 20], 2
    import torch

    from batchinfer.engine.model.fused_experts import StackedExperts, route, use_triton_experts
    from batchinfer.engine.model.ops import TorchOps

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    ops = TorchOps
    if device.type == "cuda":
        from batchinfer.engine.triton_ops import TritonOps

        ops = TritonOps
    gen = torch.Generator().manual_seed(0)
    per_expert = StackedExperts(args.experts, args.hidden, args.rows)
    with torch.no_grad():
        per_expert.gate_up.copy_(torch.randn(per_expert.gate_up.shape, generator=gen) * 0.02)
        per_expert.down.copy_(torch.randn(per_expert.down.shape, generator=gen) * 0.02)
    per_expert = per_expert.to(device, dtype)
    grouped = StackedExperts(args.experts, args.hidden, args.rows).to(device, dtype)
    grouped.load_state_dict(per_expert.state_dict())
    use_triton_experts(grouped)
    expert_bytes = 3 * args.hidden * args.rows * torch.tensor([], dtype=dtype).element_size()
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=gen).to(device, dtype)
        weights, ids = route(torch.randn(tokens, args.experts, generator=gen), args.top_k, True)
        weights, ids = weights.to(device), ids.to(device)
        with torch.inference_mode():
            ours = grouped(x, weights, ids, ops)
            theirs = per_expert(x, weights, ids, ops)
            error = ((ours.float() - theirs.float()).abs().max()
                     / theirs.float().abs().max().clamp_min(1e-12)).item()
            triton_s = _timed(lambda: grouped(x, weights, ids, ops), device, args.repeats)
            torch_s = _timed(lambda: per_expert(x, weights, ids, ops), device, args.repeats)
        touched = int(torch.unique(ids).numel())
        rows.append({"tokens": tokens, "experts_touched": touched,
                     "triton_ms": round(triton_s * 1e3, 3), "torch_ms": round(torch_s * 1e3, 3),
                     "speedup": round(torch_s / triton_s, 2),
                     "triton_weight_GBps": round(touched * expert_bytes / triton_s / 1e9, 1),
                     "max_rel_error": round(error, 5)})
        print(rows[-1], file=sys.stderr, flush=True)
    emit({"device": str(device),
          **({"card": torch.cuda.get_device_name()} if device.type == "cuda" else {}),
          "dtype": args.dtype, "experts": args.experts, "top_k": args.top_k,
          "hidden": args.hidden, "rows": args.rows, "repeats": args.repeats, "layer": rows})


if __name__ == "__main__":
    main()
