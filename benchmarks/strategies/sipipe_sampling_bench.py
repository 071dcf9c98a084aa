"""SiPipe §5.1 on this CPU: sampling time per step, row-wise from scratch vs column-wise
incremental, with every sampling knob and all three penalties on.

A steady decode batch of B sequences (the paper's assumption: micro-batch n + p is micro-batch n),
V = 49,152 (SmolLM2's vocabulary), prompts of --prompt-len tokens and outputs that start at
--output-len tokens and grow by one per step. Per step, each method turns [B, V] logits into B
tokens:

- naive: vLLM's sampler: nothing kept across steps, so every sequence's prompt and output tokens
  are gathered into padded tensors from the Python lists, the [B, V] count and seen tensors built
  from scratch, the penalties applied, then the torch filters (engine/sampler.py's portable
  path, a fresh Sampler each step);
- default: this engine's row sampler on CPU (the padded tokens copied from the arrays it keeps
  per request, engine/token_history.py; penalties on the seen tokens only and the fused row
  kernel: kernels/sampling.cpp);
- column: SiPipe's column-wise replica (strategies/sipipe/column_sampler.py): logits arrive [V, B], the
  penalty buffers are updated with only the B new tokens, the column kernels run in place.
The logits are fresh random numbers each step (a copy, outside the timing); the time of a step
is everything from logits to tokens, including the bookkeeping each method needs for the next
step. Medians over --steps after 2 warm-up steps. host_costs.py times the column method the same
way (make_sequences and column_method, imported as benchmarks.strategies.sipipe_sampling_bench).

    python benchmarks/strategies/sipipe_sampling_bench.py [--batch 64 256] [--steps 15] [--threads 1]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import SIPIPE_SAMPLING, emit  # noqa: E402

VOCAB = 49152        # SmolLM2's


def make_sequences(batch: int, prompt_len: int, output_len: int, rng: random.Random):
    """batch sequences with SiPipe's evaluation sampling (seeded per row), random prompts of
    prompt_len tokens and outputs of output_len so far."""
    from batchinfer.engine.request import Request, SamplingParams, Sequence

    seqs = []
    for i in range(batch):
        params = SamplingParams(seed=i, **SIPIPE_SAMPLING)
        seq = Sequence(request=Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(prompt_len)],
                                       params))
        seq.output_token_ids = [rng.randrange(VOCAB) for _ in range(output_len)]
        seqs.append(seq)
    return seqs


def _row_method(seqs, native: bool, logits_steps, keep_state: bool = True) -> list[float]:
    from batchinfer.engine.sampler import Sampler

    sampler = Sampler(VOCAB, (0,), torch.device("cpu"), native_kernels=native)
    times = []
    for logits in logits_steps:
        start = time.perf_counter()
        if not keep_state:                    # nothing kept across steps (vLLM's)
            sampler = Sampler(VOCAB, (0,), torch.device("cpu"), native_kernels=native)
        tokens, _ = sampler.sample(logits, sampler.prepare(seqs))
        for seq, token in zip(seqs, tokens.tolist()):
            seq.output_token_ids.append(token)
        times.append(time.perf_counter() - start)
    return times


def column_method(seqs, native: bool, logits_steps, max_len: int) -> list[float]:
    """Seconds per step of SiPipe's column-wise sampler over logits_steps ([B, V] each)."""
    from batchinfer.strategies.sipipe.column_sampler import ColumnSampler
    from batchinfer.strategies.sipipe.columns import ColumnAssigner, ColumnJoin

    batch = len(seqs)
    sampler = ColumnSampler(VOCAB, batch, max_len, (0,), native_kernels=native)
    assigner = ColumnAssigner(batch)
    by_id = {s.request_id: s for s in seqs}
    ids = [s.request_id for s in seqs]

    def join_of(rid, col):                    # once per sequence (the first, warm-up step)
        seq = by_id[rid]
        return ColumnJoin(col, rid, seq.request.prompt_token_ids, list(seq.output_token_ids),
                          seq.request.sampling, seq.request.sampling.seed)

    times = []
    for logits in logits_steps:
        logits_t = logits.t().contiguous()    # how the last stage delivers them
        start = time.perf_counter()
        _, update = assigner.assign(ids, [len(s.output_token_ids) for s in seqs], join_of)
        sampler.apply(update)
        tokens, _ = sampler.sample(logits_t)
        for seq, token in zip(seqs, tokens):
            seq.output_token_ids.append(token)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    from batchinfer.engine.kernels import load_native_kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (a SiPipe sampler process runs with sampler_threads=1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = load_native_kernels()
    results = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        steps = args.steps + 2
        logits = [torch.randn(batch, VOCAB, generator=gen) * 3 for _ in range(steps)]
        row = {"batch": batch, "vocab": VOCAB}
        methods = {"naive": lambda s, lg: _row_method(s, False, lg, keep_state=False),
                   "default": lambda s, lg: _row_method(s, native, lg),
                   "column": lambda s, lg: column_method(
                       s, native, lg, args.output_len + steps + 1)}
        for name, method in methods.items():
            seqs = make_sequences(batch, args.prompt_len, args.output_len, random.Random(batch))
            times = method(seqs, [t.clone() for t in logits])[2:]
            row[f"{name}_ms"] = round(statistics.median(times) * 1e3, 2)
        row["naive_over_column"] = round(row["naive_ms"] / row["column_ms"], 2)
        row["default_over_column"] = round(row["default_ms"] / row["column_ms"], 2)
        results.append(row)
    emit({"threads": args.threads, "native_kernels": native, "params": SIPIPE_SAMPLING,
          "prompt_len": args.prompt_len, "output_len": args.output_len,
          "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
