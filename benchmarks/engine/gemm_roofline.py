"""The model's GEMM roofline: time its own matmul shapes standalone and turn that into tok/s.

One decode step of a batch of M sequences runs, per layer, the qkv, o, gate_up and down
projections at M rows, plus the LM head once. Timing exactly those GEMMs (same thread count, each
layer its own weights) with every kernel the engine has for the weights' dtype
(engine/model/fast_linear.py: the blocked kernel, oneDNN's packed GEMM, and for bf16 the dpbf16
kernel on an AVX512-BF16 CPU, the amx kernel on an AMX one) and keeping the fastest gives the
decode throughput no engine of ours can beat on this machine, whichever kernel it runs. A whole workload also has to
prefill its prompts: the workload roofline adds those GEMMs (w_decode.py reports both).

    python benchmarks/engine/gemm_roofline.py --batch 128 256 512
    python benchmarks/engine/gemm_roofline.py --kernel onednn    # one kernel only
    python benchmarks/engine/gemm_roofline.py --batch 16 --threads 1 --no-prefetch
    python benchmarks/engine/gemm_roofline.py --dtype bfloat16   # bf16 weights (a bf16 model on CPU)

Prints one JSON object per batch size. RooflineSampler is also what w_decode.py and decode_floor.py
time the roofline with (imported as benchmarks.engine.gemm_roofline).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from batchinfer.engine.model.arch import ModelArch
from batchinfer.engine.model.fast_linear import (amx_available, bf16_dot_available,
                                                 blocked_kernel_available, onednn_available,
                                                 pack_linears)
from batchinfer.engine.timing import median_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, time_once  # noqa: E402


def available_kernels(weight_dtype: torch.dtype = torch.float32) -> list[str]:
    bf16 = weight_dtype == torch.bfloat16
    kernels = ["amx"] if bf16 and amx_available() else []
    kernels += ["dpbf16"] if bf16 and bf16_dot_available() else []
    kernels += ["blocked"] if blocked_kernel_available() else []
    return kernels + (["onednn"] if onednn_available() else []) or ["torch"]


def _linear(out_f: int, in_f: int, kernel: str, weight_dtype: torch.dtype = torch.float32):
    """As the engine lays it out (pack_linears: a width that does not split into the blocked
    kernel's panels runs on oneDNN), its weights in `weight_dtype` (bf16: fp32 in and out)."""
    holder = nn.Sequential(nn.Linear(in_f, out_f, bias=False))
    pack_linears(holder, kernel, weight_dtype)
    return holder[0]


class _ModelGemms:
    """One layer's four projections (with distinct weights per layer, as the model streams them)
    and the LM head, laid out for `kernel` as the engine does."""

    def __init__(self, arch: ModelArch, kernel: str, weight_dtype: torch.dtype = torch.float32):
        h, i = arch.hidden_size, arch.intermediate_size
        self.arch = arch

        def linear(out_f: int, in_f: int):
            return _linear(out_f, in_f, kernel, weight_dtype)

        self.layers = [[linear(arch.q_size + 2 * arch.kv_size, h), linear(h, arch.q_size),
                        linear(2 * i, h), linear(h, i)] for _ in range(arch.num_layers)]
        self.head = linear(arch.vocab_size, h)

    def seconds(self, layer_rows: int, head_rows: int, repeats: int) -> float:
        """Median time of the layers' GEMMs at layer_rows rows plus the head at head_rows."""
        return median_seconds(self.runner(layer_rows, head_rows), repeats)

    def runner(self, layer_rows: int, head_rows: int):
        """A callable that runs those GEMMs once (inputs allocated here, not in the timing)."""
        a = self.arch
        x_h, x_q = torch.randn(layer_rows, a.hidden_size), torch.randn(layer_rows, a.q_size)
        x_i, x_head = torch.randn(layer_rows, a.intermediate_size), torch.randn(head_rows, a.hidden_size)
        inputs = [x_h, x_q, x_h, x_i]

        def run():
            for layer in self.layers if layer_rows else ():
                for lin, x in zip(layer, inputs):
                    lin(x)
            if head_rows:
                self.head(x_head)

        return run


PREFILL_CHUNK = 2048   # rows a prefill's GEMMs are timed at (the engine's default token budget)


class RooflineSampler:
    """The decode step's GEMMs timed now and then *during* a run, in its process: on a host
    whose speed drifts by tens of percent within minutes, a roofline timed minutes apart from
    the run it bounds says little. Each `sample` times one step's GEMMs on every kernel once and
    keeps the fastest; `prefill_seconds` times the workload's prefill GEMMs the same way."""

    def __init__(self, arch: ModelArch, batch: int, kernels: list[str] | None = None,
                 weight_dtype: torch.dtype = torch.float32):
        self.batch = batch
        self.gemms = {k: _ModelGemms(arch, k, weight_dtype)
                      for k in kernels or available_kernels(weight_dtype)}
        self.steps = {k: g.runner(batch, batch) for k, g in self.gemms.items()}
        for run in self.steps.values():
            run()  # warm-up
        self.samples: list[float] = []
        self.prefill_samples: list[float] = []
        self.stream_samples: list[float] = []

    @torch.inference_mode()
    def sample(self) -> float:
        self.samples.append(min(time_once(run) for run in self.steps.values()))
        return self.samples[-1]

    @torch.inference_mode()
    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Every prompt token through the layers, one row per request through the head. The
        layers are timed on at most PREFILL_CHUNK rows and scaled to the prompts' tokens: an
        engine prefills in chunks of that order (scheduler.max_num_batched_tokens), and one
        matrix of all of a large workload's prompts (ShareGPT-500: 51,872 rows) streams its
        input from memory once per column group, slower than any chunk."""
        rows = min(prompt_tokens, PREFILL_CHUNK)
        layers = min(median_seconds(g.runner(rows, 0), 1) for g in self.gemms.values())
        head = min(median_seconds(g.runner(0, self.batch), 1) for g in self.gemms.values())
        self.prefill_samples.append(layers * prompt_tokens / rows + head)
        return self.prefill_samples[-1]

    @torch.inference_mode()
    def stream_read_gbps(self, nbytes: int = 1 << 30) -> float:
        """What the threads read from DRAM per second, summing an fp32 buffer of nbytes (beyond
        any cache): the fastest of three passes."""
        buffer = torch.ones(nbytes // 4)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - t0)
        self.stream_samples.append(nbytes / min(times) / 1e9)
        return self.stream_samples[-1]

    def summary(self, output_tokens: int, generated: int, elapsed_s: float,
                decode_kv_bytes: int = 0) -> dict:
        """The run's fractions of the decode roofline (median sample) and of the workload's
        (prefill GEMMs plus output_tokens - 1 decode steps), plus the same against the fastest
        sample. With decode_kv_bytes (the K/V the decode steps' attention reads, all layers) and
        stream samples: the ceiling on those fractions for an engine that runs only the GEMMs at
        the roofline and reads that K/V once at the fastest stream rate, nothing else."""
        out = self._workload(self.batch * output_tokens, self.batch * (output_tokens - 1),
                             generated / elapsed_s, decode_kv_bytes)
        if "kv_read_s_at_stream_rate" in out:
            decode_s = (output_tokens - 1) * statistics.median(self.samples)
            out["ceiling_with_kv_read"] = round(
                decode_s / (decode_s + out["kv_read_s_at_stream_rate"]), 3)
        out["step_ms_worst"] = round(max(self.samples) * 1e3, 2)
        for label, step in (("", statistics.median(self.samples)), ("_vs_best", min(self.samples))):
            decode_tps = self.batch / step
            out[f"roofline_tok_per_s{label}"] = round(decode_tps, 1)
            out[f"fraction_of_roofline{label}"] = round(generated / elapsed_s / decode_tps, 3)
        return out

    def mixed_summary(self, generated: int, requests: int, elapsed_s: float,
                      decode_kv_bytes: int = 0) -> dict:
        """For a workload whose requests each have their own length, so the decode batch is not
        one size (ShareGPT at its reference lengths): its GEMMs at the sampler's batch, the most
        sequences the engine holds (every prompt token through the layers as prefill_seconds
        times them; each later output token one row of a full decode step), the fastest the
        hardware runs the workload's matrix products at that limit. The run's fraction of it,
        at the median and at the fastest sample; with decode_kv_bytes, the ceiling on it for an
        engine that also reads the decode steps' K/V once at the fastest stream rate."""
        # a request's first token comes from its prefill
        out = self._workload(generated, generated - requests, generated / elapsed_s,
                             decode_kv_bytes)
        out["batch"] = self.batch
        return out

    def _workload(self, tokens: int, decode_rows: int, ours: float, decode_kv_bytes: int) -> dict:
        """The workload roofline both summaries report: the prompts' GEMMs (prefill_seconds) and
        `decode_rows` rows of full decode steps for `tokens` output tokens, at the median and the
        fastest sample; `ours` (tok/s) as a fraction of each; the K/V-read ceiling."""
        median_step, best_step = statistics.median(self.samples), min(self.samples)
        prefill = statistics.median(self.prefill_samples) if self.prefill_samples else 0.0
        out = {"samples": len(self.samples), "step_ms_median": round(median_step * 1e3, 2),
               "step_ms_best": round(best_step * 1e3, 2), "prefill_gemm_s": round(prefill, 3)}
        if decode_kv_bytes and self.stream_samples:
            gbps = max(self.stream_samples)
            kv_s = decode_kv_bytes / gbps / 1e9
            gemm_s = prefill + decode_rows * median_step / self.batch
            out.update({"decode_kv_read_gb": round(decode_kv_bytes / 1e9, 2),
                        "stream_read_gbps": round(gbps, 1), "kv_read_s_at_stream_rate": round(kv_s, 3),
                        "workload_ceiling_with_kv_read": round(gemm_s / (gemm_s + kv_s), 3)})
        for label, step in (("", median_step), ("_vs_best", best_step)):
            workload_tps = tokens / (prefill + decode_rows * step / self.batch)
            out[f"workload_roofline_tok_per_s{label}"] = round(workload_tps, 1)
            out[f"fraction_of_workload_roofline{label}"] = round(ours / workload_tps, 3)
        return out


@torch.inference_mode()
def gemm_roofline(arch: ModelArch, batch: int, repeats: int = 5, kernels: list[str] | None = None,
                  prompt_tokens: int = 0, output_tokens: int = 0,
                  weight_dtype: torch.dtype = torch.float32) -> dict:
    """Decode-step roofline at `batch` rows, over the fastest of `kernels` (default: every one
    available here); with prompt_tokens and output_tokens (per request, batch requests) also the
    workload's: its prefill GEMMs (every prompt token through the layers, one row per request
    through the head) plus output_tokens - 1 decode steps."""
    step_ms = {}
    for kernel in kernels or available_kernels(weight_dtype):
        gemms = _ModelGemms(arch, kernel, weight_dtype)
        step_ms[kernel] = (gemms.seconds(batch, batch, repeats), gemms)
    kernel = min(step_ms, key=lambda k: step_ms[k][0])
    step_s, gemms = step_ms[kernel]
    out = {"batch": batch, "step_ms": round(step_s * 1e3, 2),
           "gflops": round(arch.flops_per_token() * batch / step_s / 1e9, 1),
           "roofline_tok_per_s": round(batch / step_s, 1), "kernel": kernel,
           "weight_dtype": str(weight_dtype).replace("torch.", ""),
           "step_ms_by_kernel": {k: round(v[0] * 1e3, 2) for k, v in step_ms.items()},
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
    ap.add_argument("--kernel", nargs="+", choices=["amx", "dpbf16", "blocked", "onednn", "torch"],
                    default=None,
                    help="time only these kernels (default: every one available here)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' dtype (bfloat16: as a bf16 model on CPU runs its linears)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, every core here)")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="the blocked kernel without its next-panel prefetch")
    ap.add_argument("--narrow-tile", action="store_true",
                    help="the blocked kernel's AVX2 tile on an AVX-512 build")
    args = ap.parse_args()
    from batchinfer.engine.model.fast_linear import BlockedLinear

    BlockedLinear.prefetch, BlockedLinear.wide = not args.no_prefetch, not args.narrow_tile
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, model_id = resolve_model_dir(args.model)
    arch = load_arch(model_dir)
    for b in args.batch:
        emit({"model": model_id, **gemm_roofline(arch, b, kernels=args.kernel,
                                                 weight_dtype=getattr(torch, args.dtype))},
             indent=None)


if __name__ == "__main__":
    main()
