"""In-process A/A/B of an engine switch that is read on every call (a class attribute of the
engine's, e.g. NativeOps.fuse_silu_mul or BlockedLinear.prefetch), on W-decode.

This host's speed drifts by 10-30% between runs minutes apart, more than a few-percent change is
worth, so separate invocations cannot resolve one. Here one engine runs three arms per round, off,
off again (the control: what the noise alone gives) and on, rotated round to round, and each
ratio is taken within a round; medians.

    python benchmarks/probes/switch_ab.py --switch batchinfer.engine.model.ops:NativeOps.fuse_silu_mul
    python benchmarks/probes/switch_ab.py --switch batchinfer.engine.model.fast_linear:BlockedLinear.prefetch

Prints one JSON object: output tok/s per arm and round, and the medians of on / off and of the
control / off.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, warm_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, help="module:Class.attribute, a boolean the engine "
                    "reads on every call (off arms: False, on arm: True)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=128)
    args = ap.parse_args()

    from batchinfer.engine.request import SamplingParams

    engine, prompts = warm_engine(None, args.concurrency)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    module, _, path = args.switch.partition(":")
    owner_name, _, attribute = path.rpartition(".")
    owner = getattr(importlib.import_module(module), owner_name)
    arms = [("off", False), ("control", False), ("on", True)]
    rates: dict[str, list[float]] = {name: [] for name, _ in arms}
    saved = getattr(owner, attribute)
    try:
        for r in range(args.rounds):
            for name, value in arms[r % 3:] + arms[:r % 3]:
                setattr(owner, attribute, value)
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                rates[name].append(sum(o.num_output_tokens for o in outs) / (time.perf_counter() - start))
    finally:
        setattr(owner, attribute, saved)

    def median_ratio(name: str) -> float:
        return round(statistics.median(a / b for a, b in zip(rates[name], rates["off"])), 3)

    emit({
        "switch": args.switch, "rounds": args.rounds,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "output_tok_per_s": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "on_over_off_median": median_ratio("on"), "control_over_off_median": median_ratio("control"),
    }, indent=None)


if __name__ == "__main__":
    main()
