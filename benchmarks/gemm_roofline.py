"""The model's GEMM roofline: time its own matmul shapes standalone and turn that into tok/s.

One decode step of a batch of M sequences runs, per layer, the qkv, o, gate_up and down
projections at M rows, plus the LM head once. Timing exactly those GEMMs (same packed oneDNN path
the engine uses, same thread count, each layer its own weights) gives the decode throughput no
engine can beat on this machine. A whole workload also has to prefill its prompts: the workload
roofline adds those GEMMs (w_decode.py reports both).

    python benchmarks/gemm_roofline.py --batch 128 256 512
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from batchinfer.engine.model.arch import ModelArch
from batchinfer.engine.model.fast_linear import PackedLinear, onednn_available
from batchinfer.engine.timing import median_seconds


def _linear(out_f: int, in_f: int, packed: bool):
    lin = nn.Linear(in_f, out_f, bias=False)
    return PackedLinear(lin) if packed else lin


class _ModelGemms:
    """One layer's four projections (with distinct weights per layer, as the model streams them)
    and the LM head, packed like the engine's."""

    def __init__(self, arch: ModelArch, packed: bool):
        h, i = arch.hidden_size, arch.intermediate_size
        self.arch = arch
        self.layers = [[_linear(arch.q_size + 2 * arch.kv_size, h, packed), _linear(h, arch.q_size, packed),
                        _linear(2 * i, h, packed), _linear(h, i, packed)] for _ in range(arch.num_layers)]
        self.head = _linear(arch.vocab_size, h, packed)

    def seconds(self, layer_rows: int, head_rows: int, repeats: int) -> float:
        """Median time of the layers' GEMMs at layer_rows rows plus the head at head_rows."""
        a = self.arch
        x_h, x_q = torch.randn(layer_rows, a.hidden_size), torch.randn(layer_rows, a.q_size)
        x_i, x_head = torch.randn(layer_rows, a.intermediate_size), torch.randn(head_rows, a.hidden_size)
        inputs = [x_h, x_q, x_h, x_i]

        def run():
            for layer in self.layers:
                for lin, x in zip(layer, inputs):
                    lin(x)
            self.head(x_head)

        return median_seconds(run, repeats)


@torch.inference_mode()
def gemm_roofline(arch: ModelArch, batch: int, repeats: int = 5, packed: bool = True,
                  prompt_tokens: int = 0, output_tokens: int = 0) -> dict:
    """Decode-step roofline at `batch` rows; with prompt_tokens and output_tokens (per request,
    batch requests) also the workload's: its prefill GEMMs (every prompt token through the
    layers, one row per request through the head) plus output_tokens - 1 decode steps."""
    packed = packed and onednn_available()
    gemms = _ModelGemms(arch, packed)
    step_s = gemms.seconds(batch, batch, repeats)
    out = {"batch": batch, "step_ms": round(step_s * 1e3, 2),
           "gflops": round(arch.flops_per_token() * batch / step_s / 1e9, 1),
           "roofline_tok_per_s": round(batch / step_s, 1), "packed_onednn": packed,
           "threads": torch.get_num_threads()}
    if prompt_tokens and output_tokens:
        prefill_s = gemms.seconds(prompt_tokens, batch, max(1, repeats // 2))
        total_s = prefill_s + (output_tokens - 1) * step_s
        out.update({"prefill_gemm_s": round(prefill_s, 3), "workload_gemm_s": round(total_s, 3),
                    "workload_roofline_tok_per_s": round(batch * output_tokens / total_s, 1)})
    return out


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
