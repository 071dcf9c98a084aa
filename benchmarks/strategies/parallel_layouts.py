"""Multi-process runtime: output tok/s of each parallel layout vs the single-process engine.

Workload: the first N requests of the ShareGPT V3 sample (benchmarks/common.py: real ShareGPT V3
prompts; max_tokens = the reference reply's length with ignore_eos, so every layout does the same
work), greedy, all submitted at time 0. SmolLM2-135M fp32 on all cores, except TP=2, which needs
heads that divide by 2: a dummy-weight model of the same shape with 8 heads / 4 kv heads, compared
with the single-process engine on the same dummy model. Each configuration runs in a fresh
process; figures follow `vllm bench throughput` (model load excluded). Per-rank bubble ratios come
from the workers' timelines.

    python benchmarks/strategies/parallel_layouts.py --requests 200
    python benchmarks/strategies/parallel_layouts.py --requests 100 --only single pp2-hb

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, sharegpt_path, sharegpt_rows, timed_generate  # noqa: E402

DUMMY_TP = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}

CONFIGS = {
    "single": {},
    "pp2-sb": {"parallel": {"pp": 2}, "scheduler": {"policy": "sb"}},
    "pp2-hb": {"parallel": {"pp": 2}, "scheduler": {"policy": "hb"}},
    "dp2": {"parallel": {"dp": 2}},
    "single-dummy8": {"model": {"load_format": "dummy", "hf_overrides": DUMMY_TP}},
    "tp2-dummy8": {"model": {"load_format": "dummy", "hf_overrides": DUMMY_TP},
                   "parallel": {"tp": 2}},
}


def run_config(name: str, n: int, pp_layers: list[int] | None = None) -> dict:
    """Inside a fresh process."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    sections = json.loads(json.dumps(CONFIGS[name]))
    sections.setdefault("model", {})["max_model_len"] = 2048
    sections.setdefault("scheduler", {}).setdefault("max_num_seqs", 256)
    if pp_layers and sections.get("parallel", {}).get("pp", 1) > 1:
        sections["parallel"]["pp_layers"] = pp_layers
    rows = sharegpt_rows()[:n]
    with Engine.from_config(EngineConfig(**sections)) as engine:
        engine.generate(["warm-up"], SamplingParams(max_tokens=2, temperature=0))
        outs, elapsed, n_in, n_out = timed_generate(engine, rows)
        stats = engine.stats()
    pipeline = stats.get("pipeline") or {}
    return {"config": name, "layers_per_stage": engine.info.get("layers_per_stage"),
            "requests": len(outs), "elapsed_s": round(elapsed, 2),
            "output_tok_per_s": round(n_out / elapsed, 1),
            "total_tok_per_s": round((n_in + n_out) / elapsed, 1),
            "requests_per_s": round(len(outs) / elapsed, 3),
            "prompt_tokens": n_in, "output_tokens": n_out, "steps": stats["steps"],
            "preemptions": stats["num_preemptions"],
            "bubble_ratio_by_stage": pipeline.get("bubble_ratio_by_stage"),
            "bubble_ratio_by_rank": [r["bubble_ratio"] for r in pipeline.get("ranks", [])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--pp-layers", type=int, nargs="+", default=None,
                    help="layers per stage for the pp configurations (default: the engine's split)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_config(args.worker, args.requests, args.pp_layers)))
        return
    workload = sharegpt_path()   # generated here once, before the workers read it
    results = {}
    for name in args.only:
        extra = ["--pp-layers", *map(str, args.pp_layers)] if args.pp_layers else []
        proc = subprocess.run([sys.executable, __file__, "--worker", name, "--requests",
                               str(args.requests), *extra], capture_output=True, text=True)
        if proc.returncode != 0:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1:]}
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[name]), file=sys.stderr)
    base = results.get("single", {}).get("output_tok_per_s")
    base_dummy = results.get("single-dummy8", {}).get("output_tok_per_s")
    for name, r in results.items():
        ref = base_dummy if "dummy" in name else base
        if ref and "output_tok_per_s" in r:
            r["vs_single_process"] = round(r["output_tok_per_s"] / ref, 3)
    emit({"workload": str(workload), "requests": args.requests, "results": results})


if __name__ == "__main__":
    main()
