"""The per-step host (CPU) work of this engine's pipeline ranks, measured on this machine: the
constants sim/hardware.py prices GPU presets' host work with (SiPipe's bubbles, §3.1).

- input_prep: a worker turning a StepPlan into model inputs in its versioned buffers
  (engine/runtime/input_prep.py VersionedInputs.fill): decode plans of B sequences with contexts
  of C tokens and prefill chunks (block size 16); least-squares fit on (1, seqs, block-table
  entries (rows x the widest table: the tables are padded), query tokens).
- sampler_prepare: the default sampler's per-step host work before its kernels
  (engine/sampler.py Sampler.prepare: per-row parameters, and for rows with penalties the padded
  prompt and output tokens, copied from the arrays engine/token_history.py keeps), steady
  decoding (one new token per row per step) with SiPipe's evaluation sampling (every knob and all
  three penalties); fit on (rows, penalty history tokens).
- sampler_device: what the default sampler's portable path (the one that runs on CUDA) moves
  through memory per step, counted op by op under a dispatch mode (bytes of every non-view op's
  tensor inputs and outputs) and its op count (kernel launches): greedy rows and the full knobs.
- column_sampler: SiPipe's column-wise incremental sampler on one thread, seconds per logit
  (benchmarks/strategies/sipipe_sampling_bench.py's column method, the same knobs and penalties).

    python benchmarks/sim/host_costs.py [--repeats 7]

Prints one JSON object. Medians over --repeats.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchinfer.engine.timing import median_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import SIPIPE_SAMPLING, emit  # noqa: E402
from benchmarks.strategies.sipipe_sampling_bench import (  # noqa: E402
    VOCAB, column_method, make_sequences)

BLOCK_SIZE = 16


def _fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(x, y).solution.squeeze(1).tolist()


def _plan(rng: random.Random, seqs: int, query: int, context: int):
    """`seqs` sequences of `query` new tokens each over `context` cached ones."""
    from batchinfer.engine.step_plan import StepPlan

    width = -(-(context + query) // BLOCK_SIZE)
    return StepPlan(0, [rng.randrange(VOCAB) for _ in range(seqs * query)], [query] * seqs,
                    [context + query] * seqs,
                    [[rng.randrange(100_000) for _ in range(width)] for _ in range(seqs)],
                    list(range(seqs)), [f"r{i}" for i in range(seqs)], [1] * seqs), width


def measure_input_prep(repeats: int) -> dict:
    from batchinfer.engine.runtime.input_prep import VersionedInputs

    rng = random.Random(0)
    shapes = [(seqs, 1, context) for seqs in (16, 64, 128, 256) for context in (256, 1024)]
    shapes += [(4, 256, 0), (4, 1024, 0), (16, 128, 0), (8, 512, 512)]     # prefill chunks
    points, xs, ys = [], [], []
    for seqs, query, context in shapes:
        plan, width = _plan(rng, seqs, query, context)
        inputs = VersionedInputs(BLOCK_SIZE, torch.device("cpu"))
        s = median_seconds(lambda: inputs.fill(0, plan), repeats)
        points.append({"seqs": seqs, "query": query, "context": context, "ms": round(s * 1e3, 4)})
        xs.append([1.0, seqs, seqs * width, seqs * query])
        ys.append(s)
    per_step, per_seq, per_block, per_token = _fit(xs, ys)
    return {"points": points, "per_step_s": per_step, "per_seq_s": per_seq,
            "per_block_s": per_block, "per_token_s": per_token}


def measure_sampler_prepare(repeats: int) -> dict:
    from batchinfer.engine.sampler import Sampler

    sampler = Sampler(VOCAB, (0,), torch.device("cpu"))
    points, xs, ys = [], [], []
    for batch in (32, 128):
        for prompt_len, output_len in ((300, 100), (1000, 300)):
            seqs = make_sequences(batch, prompt_len, output_len, random.Random(batch))

            def step():                    # steady decoding: one new token per row per step
                for seq in seqs:
                    seq.output_token_ids.append(1)
                sampler.prepare(seqs)
            s = median_seconds(step, repeats)
            history = batch * (prompt_len + output_len)
            points.append({"rows": batch, "history_tokens": history, "ms": round(s * 1e3, 4)})
            xs.append([batch, history])
            ys.append(s)
    per_row, per_token = _fit(xs, ys)
    return {"points": points, "per_row_s": per_row, "per_penalty_token_s": per_token}


class _TrafficCounter(TorchDispatchMode):
    """Bytes of every non-view op's tensor inputs and outputs, and the op count."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops += 1
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
            self.bytes += sum(t.numel() * t.element_size() for t in flat
                              if isinstance(t, torch.Tensor))
        return out


def measure_sampler_device(batch: int = 32) -> dict:
    from batchinfer.engine.request import SamplingParams
    from batchinfer.engine.sampler import Sampler

    sampler = Sampler(VOCAB, (0,), torch.device("cpu"))
    logits = torch.randn(batch, VOCAB) * 3
    out = {}
    for name in ("greedy", "full"):
        seqs = make_sequences(batch, 300, 100, random.Random(batch))
        if name == "greedy":
            for seq in seqs:
                seq.request.sampling = SamplingParams(temperature=0.0)
        prepared = sampler.prepare(seqs)
        counter = _TrafficCounter()
        with counter:
            sampler.sample(logits.clone(), prepared)
        out[name] = {"bytes_per_logit": counter.bytes / (batch * VOCAB), "kernels": counter.ops}
    out["batch"] = batch
    return out


def measure_column_sampler(repeats: int, batch: int = 64) -> dict:
    from batchinfer.engine.kernels import load_native_kernels

    native = load_native_kernels()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(batch)
    logits = [torch.randn(batch, VOCAB, generator=gen) * 3 for _ in range(repeats + 2)]
    seqs = make_sequences(batch, 300, 200, random.Random(batch))
    times = column_method(seqs, native, logits, 200 + repeats + 3)[2:]
    s = statistics.median(times)
    return {"batch": batch, "vocab": VOCAB, "threads": 1, "native_kernels": native,
            "ms": round(s * 1e3, 3), "per_logit_s": s / (batch * VOCAB)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    emit({"params": SIPIPE_SAMPLING,
          "input_prep": measure_input_prep(args.repeats),
          "sampler_prepare": measure_sampler_prepare(args.repeats),
          "sampler_device": measure_sampler_device(),
          "column_sampler": measure_column_sampler(args.repeats)})


if __name__ == "__main__":
    main()
