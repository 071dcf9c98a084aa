"""The model's GEMM roofline: time its own matmul shapes standalone and turn that into tok/s.

One decode step of a batch of M sequences runs, per layer, the qkv, o, gate_up and down
projections at M rows, plus the LM head once. Timing exactly those GEMMs (same packed oneDNN path
the engine uses, same thread count) gives the throughput no engine can beat on this machine.

    python benchmarks/gemm_roofline.py --batch 128 256 512
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from batchinfer.engine.model.arch import ModelArch
from batchinfer.engine.model.fast_linear import PackedLinear, onednn_available


def _linear(out_f: int, in_f: int, packed: bool):
    lin = nn.Linear(in_f, out_f, bias=False)
    return PackedLinear(lin) if packed else lin


@torch.inference_mode()
def gemm_roofline(arch: ModelArch, batch: int, repeats: int = 5, packed: bool = True) -> dict:
    packed = packed and onednn_available()
    h, i = arch.hidden_size, arch.intermediate_size
    layer = [_linear(arch.q_size + 2 * arch.kv_size, h, packed), _linear(h, arch.q_size, packed),
             _linear(2 * i, h, packed), _linear(h, i, packed)]
    head = _linear(arch.vocab_size, h, packed)
    x_h, x_q, x_i = torch.randn(batch, h), torch.randn(batch, arch.q_size), torch.randn(batch, i)
    inputs = [x_h, x_q, x_h, x_i]

    def step():
        for _ in range(arch.num_layers):
            for lin, x in zip(layer, inputs):
                lin(x)
        head(x_h)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"batch": batch, "step_ms": round(step_s * 1e3, 2),
            "gflops": round(arch.flops_per_token() * batch / step_s / 1e9, 1),
            "roofline_tok_per_s": round(batch / step_s, 1), "packed_onednn": packed,
            "threads": torch.get_num_threads()}


def main() -> None:
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.model.sources import resolve_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--plain", action="store_true", help="torch's default linear, not packed oneDNN")
    args = ap.parse_args()
    model_dir, model_id = resolve_model_dir(args.model)
    arch = load_arch(model_dir)
    for b in args.batch:
        print(json.dumps({"model": model_id, **gemm_roofline(arch, b, packed=not args.plain)}))


if __name__ == "__main__":
    main()
