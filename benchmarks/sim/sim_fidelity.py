"""Simulator fidelity: simulated vs measured output tok/s of the same jobs on this machine.

Each configuration (single process HB/SB, PP=2 SB/HB, TD-Pipe, gLLM at PP=2, DP=2) runs for real
in a fresh process (benchmarks/strategies/strategy_bench.py's harness: the first N ShareGPT
requests or prefill-heavy documents, the same KV memory for all, all submitted at time 0), and
through the simulator (sim/simulator.py: the same EngineConfig, the same strategy objects, the
measured cost model of a profile table of this machine, the same prompt token counts and output
lengths).

    python benchmarks/sim/sim_fidelity.py --profile profile.json --requests 200 --output-scale 0.5
    python benchmarks/sim/sim_fidelity.py --profile profile.json --simulate-only  # no real runs

--profile: a table `batchinfer profile` wrote (its --out/profile_table.json, or sim/profiler.py); made and saved
there first if the file does not exist. Prints one JSON object: per workload and configuration
the pair (measured, simulated), sim / measured, and the largest |error|.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import bench_requests, emit, sharegpt_path  # noqa: E402
from benchmarks.strategies.strategy_bench import engine_config, run_config  # noqa: E402

HB = {"name": "baseline", "policy": "hb", "max_num_seqs": 512, "max_num_batched_tokens": 2048}
SB = {"name": "baseline", "policy": "sb", "max_num_seqs": 512}
CONFIGS = {
    "single-hb": {"pp": 1, "strategy": HB},
    "single-sb": {"pp": 1, "strategy": SB},
    "pp2-sb": {"pp": 2, "strategy": SB},
    "pp2-hb": {"pp": 2, "strategy": HB},
    "tdpipe": {"pp": 2, "strategy": {"name": "tdpipe", "max_num_seqs": 512,
                                     "max_num_batched_tokens": 2048}},
    "gllm-pp2": {"pp": 2, "strategy": {"name": "gllm", "max_num_seqs": 512}},
    "dp2-hb": {"parallel": {"dp": 2}, "strategy": HB},
}
DEFAULT = list(CONFIGS)          # the fidelity set
CONFIGS.update({                 # SiDP (sidp_bench.py's batching), asked for with --only
    "sidp": {"parallel": {"dp": 2}, "strategy": {**HB, "name": "sidp", "weight_slots": True}},
    "sidp-in-place": {"parallel": {"dp": 2}, "strategy": {**HB, "name": "sidp",
                                                          "weight_slots": False}},
    "sidp-bth-16": {"parallel": {"dp": 2}, "strategy": {**HB, "name": "sidp", "weight_slots": True,
                                                        "batch_threshold": 16}},
})


def simulated(spec: dict, n: int, scale: float, kv_tokens: int, workload: str, table,
              tokenizer) -> dict:
    from batchinfer.sim.cost_model import MeasuredCostModel
    from batchinfer.sim.simulator import SimRequest, simulate_recipe_model

    config = engine_config(spec, kv_tokens, workload)
    rows = bench_requests(n, scale, workload)
    requests = [SimRequest(len(tokenizer.encode(r["prompt"])), r["max_tokens"], r["max_tokens"])
                for r in rows]
    result = simulate_recipe_model(config, requests, MeasuredCostModel(table),
                                   int(table.hardware["cores"]))
    return result.to_json()


def count(args, workload: str) -> int:
    return args.documents if workload == "prefill-heavy" else args.requests


def measured(name: str, args, workload: str) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name,
                           "--requests", str(count(args, workload)), "--output-scale",
                           str(args.output_scale), "--kv-tokens", str(args.kv_tokens),
                           "--workloads", workload], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_or_profile(path: Path):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.sim.profile_table import ProfileTable
    from batchinfer.sim.profiler import profile_machine

    if path.exists():
        return ProfileTable.load(path)
    table = profile_machine(EngineConfig(), progress=lambda m, *_: print(m, file=sys.stderr))
    table.save(path)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, required=False)
    ap.add_argument("--requests", type=int, default=200, help="ShareGPT requests")
    ap.add_argument("--documents", type=int, default=40, help="prefill-heavy documents")
    ap.add_argument("--output-scale", type=float, default=0.5)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "prefill-heavy"],
                    choices=["sharegpt", "prefill-heavy"])
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=DEFAULT)
    ap.add_argument("--simulate-only", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_config(CONFIGS[args.worker], args.worker, args.requests,
                                    args.output_scale, args.kv_tokens, "oracle",
                                    args.workloads[0])))
        return
    if args.profile is None:
        ap.error("--profile PATH is required (made there if missing)")
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.build import model_setup

    sharegpt_path()   # the workload, generated here once, before the workers read it
    table = load_or_profile(args.profile)
    tokenizer = model_setup(EngineConfig()).tokenizer
    pairs, errors = [], []
    for workload in args.workloads:
        for name in args.only:
            sim = simulated(CONFIGS[name], count(args, workload), args.output_scale, args.kv_tokens,
                            workload, table, tokenizer)
            row = {"workload": workload, "config": name,
                   "simulated_output_tok_per_s": sim["output_tok_per_s"],
                   "simulated": {k: sim[k] for k in ("elapsed_s", "steps", "preemptions",
                                                     "bubble_ratio_by_stage", "phase_switches",
                                                     "kv_capacity_tokens")}}
            if not args.simulate_only:
                real = measured(name, args, workload)
                row["measured_output_tok_per_s"] = real.get("output_tok_per_s")
                row["measured"] = {k: real.get(k) for k in (
                    "elapsed_s", "steps", "preemptions", "bubble_ratio_by_stage",
                    "phase_switches", "kv_capacity_tokens", "error") if k in real}
                if real.get("output_tok_per_s"):
                    ratio = sim["output_tok_per_s"] / real["output_tok_per_s"]
                    row["sim_over_measured"] = round(ratio, 3)
                    errors.append(abs(ratio - 1))
            pairs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    emit({"profile": str(args.profile), "requests": args.requests, "documents": args.documents,
          "output_scale": args.output_scale, "kv_tokens": args.kv_tokens,
          "max_abs_error": round(max(errors), 3) if errors else None,
          "median_abs_error": round(statistics.median(errors), 3) if errors else None,
          "within_10_percent": sum(e <= 0.10 for e in errors), "pairs": pairs})


if __name__ == "__main__":
    main()
