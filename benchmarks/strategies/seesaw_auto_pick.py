"""What `decode_tp: auto` + `prefill_layout: auto` pick for seesaw_bench.py's workload, and the
simulated throughput of every alternative: the run's own choosing step (sim/auto_settings.py) on
the same requests, model (the 8 / 4-head dummy of SmolLM2's shape), ranks and KV memory as the
bench's Seesaw configurations. Compare its ranking with the measured rows of the four Seesaw
layout pairs:

    python benchmarks/strategies/seesaw_auto_pick.py --workload prefill-heavy --requests 16
    python benchmarks/strategies/seesaw_bench.py --workload prefill-heavy --requests 16 --repeat 3 \
        --only seesaw seesaw-pp2-only seesaw-tp2-tp2 seesaw-tp2-pp2

The first run profiles this machine for the model (minutes; kept in the setup cache, so the
bench's later `auto` runs and this script's reruns reuse it; --costs takes a table or a preset).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402
from benchmarks.strategies.seesaw_bench import CONFIGS  # noqa: E402
from benchmarks.strategies.strategy_bench import engine_config, workload_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["sharegpt", "prefill-heavy"], default="prefill-heavy")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-scale", type=float, default=1.0)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--costs", default="measured", help="measured, a profile table or a preset")
    args = ap.parse_args()

    from batchinfer.runner.recipe import Recipe
    from batchinfer.sim.auto_settings import resolve_auto_settings

    spec = dict(CONFIGS["seesaw"])
    spec["strategy"] = {**spec["strategy"], "decode_tp": "auto", "decode_pp": "auto",
                        "prefill_layout": "auto", "layout_costs": args.costs,
                        "layout_sample_requests": args.requests}
    config = engine_config(spec, args.kv_tokens, args.workload)
    recipe = Recipe(model=config.model, memory=config.cache, parallel=config.parallel,
                    device=config.device, strategy=spec["strategy"], predictor={"name": "none"},
                    sampling={"temperature": 0.0})
    rows = workload_rows(args.requests, args.output_scale, args.workload)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"],
                                               "max_tokens": r["max_tokens"], "ignore_eos": True})
                                   + "\n" for r in rows))
        t0 = time.perf_counter()
        resolution = resolve_auto_settings(recipe, prompts)
        seconds = time.perf_counter() - t0
    emit({"workload": args.workload, "requests": args.requests,
          "output_scale": args.output_scale, "kv_tokens": args.kv_tokens,
          "seconds_with_any_profiling": round(seconds, 1), "auto_settings": resolution.record})


if __name__ == "__main__":
    main()
