"""In-process A/B of the CPU KV cache in transparent huge pages vs 4 KiB pages, on W-decode.

The switch (BATCHINFER_KV_HUGE_PAGES) is read when the cache is allocated, so this builds two
engines in one process, one per arm, and alternates them round by round (the order rotates);
each round's ratio is taken within the round, as this host's speed drifts between minutes.
Also reports how long each engine took to build (the huge-page cache is zeroed, so faulted,
at build time) and how much of this process's memory the kernel put in huge pages.

    python benchmarks/probes/kv_huge_pages_ab.py --rounds 4 --max-tokens 128

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, warm_engine  # noqa: E402


def main() -> None:
    from batchinfer.engine.kv_cache import _anon_huge_page_bytes
    from batchinfer.engine.request import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=128)
    args = ap.parse_args()
    engines, build_s, huge_mib = {}, {}, {}
    for arm, value in (("plain", "0"), ("huge", "1")):
        os.environ["BATCHINFER_KV_HUGE_PAGES"] = value
        before, start = _anon_huge_page_bytes(), time.perf_counter()
        engines[arm], prompts = warm_engine(None, args.n)
        build_s[arm] = round(time.perf_counter() - start, 2)
        huge_mib[arm] = round((_anon_huge_page_bytes() - before) / 2**20)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rounds = []
    for r in range(args.rounds):
        tok_s = {}
        for arm in (("plain", "huge") if r % 2 == 0 else ("huge", "plain")):
            start = time.perf_counter()
            outs = engines[arm].generate(prompts, params)
            tok_s[arm] = round(sum(o.num_output_tokens for o in outs) / (time.perf_counter() - start), 1)
        rounds.append({**tok_s, "ratio": round(tok_s["huge"] / tok_s["plain"], 3)})
    emit({"n": args.n, "max_tokens": args.max_tokens, "build_s": build_s,
          "huge_page_mib": huge_mib, "rounds": rounds,
          "median_ratio": round(statistics.median(r["ratio"] for r in rounds), 3)})


if __name__ == "__main__":
    main()
