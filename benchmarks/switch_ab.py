"""In-process A/A/B of an engine switch that is read on every call (an environment variable), on
W-decode.

This host's speed drifts by 10-30% between runs minutes apart, more than a few-percent change is
worth, so separate invocations cannot resolve one. Here one engine runs three arms per round, off,
off again (the control: what the noise alone gives) and on, rotated round to round, and each
ratio is taken within a round; medians. Only switches read on each call can be compared this
way, e.g. BATCHINFER_FUSE_SILU_MUL (BATCHINFER_GEMM_PREFETCH is read once per process:
gemm_roofline.py runs with and without it instead).

    python benchmarks/switch_ab.py --variable BATCHINFER_FUSE_SILU_MUL --rounds 6 --max-tokens 48

Prints one JSON object: output tok/s per arm and round, and the medians of on / off and of the
control / off.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from w_decode import DEFAULT_WORKLOAD, warm_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variable", required=True, help="the environment variable to switch")
    ap.add_argument("--off", default="0", help="its value in the off arms")
    ap.add_argument("--on", default="1", help="its value in the on arm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=128)
    args = ap.parse_args()

    from batchinfer.engine.request import SamplingParams

    engine, prompts = warm_engine(DEFAULT_WORKLOAD, args.concurrency)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    arms = [("off", args.off), ("control", args.off), ("on", args.on)]
    rates: dict[str, list[float]] = {name: [] for name, _ in arms}
    saved = os.environ.get(args.variable)
    try:
        for r in range(args.rounds):
            for name, value in arms[r % 3:] + arms[:r % 3]:
                os.environ[args.variable] = value
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                rates[name].append(sum(o.num_output_tokens for o in outs) / (time.perf_counter() - start))
    finally:
        if saved is None:
            os.environ.pop(args.variable, None)
        else:
            os.environ[args.variable] = saved

    def median_ratio(name: str) -> float:
        return round(statistics.median(a / b for a, b in zip(rates[name], rates["off"])), 3)

    print(json.dumps({
        "variable": args.variable, "off": args.off, "on": args.on, "rounds": args.rounds,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "output_tok_per_s": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "on_over_off_median": median_ratio("on"), "control_over_off_median": median_ratio("control"),
    }))


if __name__ == "__main__":
    main()
