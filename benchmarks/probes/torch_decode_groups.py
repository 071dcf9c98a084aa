"""The portable attention's decode rows, in one call or in length groups (engine/torch_attention.py).

One decode step of --seqs sequences whose contexts are spread as a ShareGPT job's are mid-run:
each is a request of the ShareGPT V3 sample (benchmarks/common.py; its prompt tokens, SmolLM2's
tokenizer, plus a uniformly drawn share of its reference reply). In one call every row's K/V is
gathered to the longest context; in groups (`GROUP_DECODE_ROWS`, the default) each group only to
its own longest.
SmolLM2-135M's heads (9 query / 3 kv heads of 64), blocks of 16, one layer; the two settings
alternate round by round and the medians are printed, with the K/V rows each gathers.

    python benchmarks/probes/torch_decode_groups.py --device cpu --seqs 256

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

from batchinfer.engine import torch_attention
from batchinfer.engine.attention import AttentionMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import embedded_source, emit, sharegpt_rows  # noqa: E402


def contexts(n: int, seed: int = 0) -> list[int]:
    """n contexts: a request's prompt tokens plus a uniform share of its reference reply."""
    rng = random.Random(seed)
    tokenizer = embedded_source().tokenizer
    rows = [(len(tokenizer.encode(r["prompt"])), r["max_tokens"]) for r in sharegpt_rows()]
    picked = rng.sample(rows, n)
    return [prompt + rng.randint(1, reply) for prompt, reply in picked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    device, bs = torch.device(args.device), 16
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lens = contexts(args.seqs)
    tables, start = [], 0
    for n in lens:
        blocks = -(-n // bs)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    meta_args = ([1] * len(lens), lens, tables, bs, device)
    kc = torch.randn(start, 3, bs, 64, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(len(lens), 9, 64, device=device, dtype=dtype)
    attention = torch_attention.TorchAttention()
    times: dict[bool, list[float]] = {True: [], False: []}
    gathered: dict[bool, int] = {}
    for _ in range(args.rounds + 1):          # the first round warms up and is dropped
        for grouped in (True, False):
            torch_attention.GROUP_DECODE_ROWS = grouped
            meta = AttentionMetadata.build(*meta_args)
            t0 = time.perf_counter()
            attention.attend(q, kc, vc, meta, 0.125)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[grouped].append(time.perf_counter() - t0)
            gathered[grouped] = sum(r.tables.numel() for r in meta.backend_plan.decode) * bs
    torch_attention.GROUP_DECODE_ROWS = True
    groups = len(torch_attention.plan(AttentionMetadata.build(*meta_args), bs, device).decode)
    one, grouped = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    emit({"seqs": len(lens), "context_tokens": sum(lens), "longest": max(lens),
          "device": str(device), "groups": groups, "one_call_ms": round(one * 1e3, 2),
          "grouped_ms": round(grouped * 1e3, 2), "speedup": round(one / grouped, 2),
          "gathered_rows_one_call": gathered[False], "gathered_rows_grouped": gathered[True]},
         indent=None)


if __name__ == "__main__":
    main()
