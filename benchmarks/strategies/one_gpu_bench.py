"""The strategies' mechanisms with every rank on one GPU (issue 40; `parallel.gpu_transport: host`),
each against its plain layout there, one fresh engine per configuration, 8 warm-up requests
outside the timed window, output tok/s over the first --requests ShareGPT rows:

- `sidp`: SiDP's two replicas against plain DP=2 at the same memory: KV tokens per replica and
  throughput in the memory-bound regime (--memory-utilization low enough that the two copies of
  the weights take most of it, where the FFN memory SiDP frees pays). SiDP's replicas read the
  one FFN store in place (its default on one GPU).
- `sipipe`: SiPipe at PP=2 with every penalty on (the paper's sampling: temperature 0.8, top-k 50,
  top-p 0.9, min-p 0.05, repetition / frequency / presence penalties, seeded per request) against
  the same pipeline sampling on the GPU (`cpu_sampling: false`), the PP=2 baseline and SiPipe
  with all its parts off; and on one rank (the whole model in one worker, CPU samplers) with
  its decode steps through two CUDA graphs per batch size (one per token-safe input version)
  and without them (`device.cuda_graphs: false`), against the single-process baseline (GPU
  sampling, graphs).

    python benchmarks/strategies/one_gpu_bench.py sidp --model examples/model-configs/llama-3.1-8b \
        --tokenizer DIR --workload sharegpt.jsonl --requests 500 --memory-utilization 0.35
    python benchmarks/strategies/one_gpu_bench.py sipipe --model DIR --workload sharegpt.jsonl \
        --requests 500

On a CPU host (`--device cpu --kv 64MiB`: an explicit cache per rank) it runs the same code: a
dry run of the script, not a figure. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import (SIPIPE_SAMPLING, emit, host_info, read_jsonl,  # noqa: E402
                               sharegpt_path)


def _config(args, strategy, parallel: dict, device: dict):
    from batchinfer.engine.config import EngineConfig

    model = {"path": str(args.model), "load_format": "dummy",
             **({"tokenizer": str(args.tokenizer)} if args.tokenizer else {}),
             **({"max_model_len": args.max_model_len} if args.max_model_len else {})}
    cache = ({"kv_cache_memory": args.kv} if args.kv
             else {"memory_utilization": args.memory_utilization})
    return EngineConfig(model=model, device={"device": args.device, **device}, cache=cache,
                        parallel={**parallel, "gpu_transport": "host"},
                        scheduler=strategy.scheduler_config(), strategy=strategy)


def _timed(engine, rows: list[dict], sampling: dict) -> tuple[float, int, int]:
    from batchinfer.engine.request import SamplingParams

    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True,
                             **({"seed": i} if sampling.get("temperature", 0) > 0 else {}),
                             **({"temperature": 0.0} | sampling))
              for i, r in enumerate(rows)]
    start = time.perf_counter()
    outs = engine.generate([r["prompt"] for r in rows], params)
    elapsed = time.perf_counter() - start
    return (elapsed, sum(o.num_prompt_tokens for o in outs),
            sum(o.num_output_tokens for o in outs))


def _run(args, config, rows: list[dict], sampling: dict) -> dict:
    import torch

    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    start = time.perf_counter()
    engine = Engine.from_config(config)
    built = time.perf_counter() - start
    try:
        engine.generate([r["prompt"] for r in rows[:8]],
                        SamplingParams(max_tokens=4, temperature=0.0))
        before = engine.stats()
        elapsed, n_in, n_out = _timed(engine, rows, sampling)
        stats, info = engine.stats(), engine.info
    finally:
        engine.close()
    out = {"build_s": round(built, 1), "elapsed_s": round(elapsed, 2),
           "prompt_tokens": n_in, "output_tokens": n_out,
           "output_tok_per_s": round(n_out / elapsed, 1),
           "kv_tokens_per_replica": (stats["kv_capacity_tokens"]
                                     // (info.get("parallel") or {}).get("dp", 1)),
           "kv_cache_bytes": info.get("kv_cache_bytes"),
           "preemptions": stats["num_preemptions"] - before["num_preemptions"],
           "gpu_transport": (info.get("parallel") or {}).get("gpu_transport")}
    if "sidp" in info:
        out.update({key: info["sidp"][key] for key in (
            "weight_slots", "ffn_store_bytes", "kv_capacity_vs_plain_dp", "batch_threshold")})
        out["cas_iteration_share"] = stats.get("strategy_stats", {}).get("cas_iteration_share")
    if "sipipe" in info:
        out["sipipe"] = info["sipipe"]
    pipeline = stats.get("pipeline", {})
    if pipeline.get("ranks"):
        out["bubble_ratio_per_rank"] = [r.get("bubble_ratio") for r in pipeline["ranks"]]
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def configurations(args) -> dict:
    """name -> (strategy params, parallel section, sampling, device settings) of the chosen
    comparison."""
    from batchinfer.runner.recipe import strategy_class

    seqs = {"max_num_seqs": args.max_num_seqs}
    if args.mechanism == "sidp":
        return {"dp2": (strategy_class("baseline")(**seqs), {"dp": 2}, {}, {}),
                "sidp": (strategy_class("sidp")(**seqs), {"dp": 2}, {}, {})}
    batching = {"policy": "hb", **seqs}
    sipipe = strategy_class("sipipe")
    return {"sipipe": (sipipe(**batching), {"pp": 2}, SIPIPE_SAMPLING, {}),
            "sipipe-gpu-sampling": (sipipe(**batching, cpu_sampling=False), {"pp": 2},
                                    SIPIPE_SAMPLING, {}),
            "pp2-hb": (strategy_class("baseline")(**batching), {"pp": 2}, SIPIPE_SAMPLING, {}),
            "sipipe-all-off": (sipipe(**batching, cpu_sampling=False, token_safe_execution=False,
                                      structure_aware_transmission=False), {"pp": 2},
                               SIPIPE_SAMPLING, {}),
            "sipipe-1rank": (sipipe(**batching), {}, SIPIPE_SAMPLING, {}),
            "sipipe-1rank-no-graphs": (sipipe(**batching), {}, SIPIPE_SAMPLING,
                                       {"cuda_graphs": False}),
            "baseline-1gpu": (strategy_class("baseline")(**batching), {}, SIPIPE_SAMPLING, {})}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mechanism", choices=("sidp", "sipipe"))
    ap.add_argument("--model", type=Path, required=True, help="a config-only model directory")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer files, where the model has none")
    ap.add_argument("--workload", type=Path, help="JSONL of prompt / max_tokens rows "
                                                  "(default: the ShareGPT sample)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory-utilization", type=float,
                    help="the memory every configuration may use; default: 0.35 for sidp (the "
                    "memory-bound regime), 0.9 (the engine's) for sipipe")
    ap.add_argument("--kv", help="an explicit memory.kv_cache_memory per rank instead")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--only", nargs="+", help="some of the mechanism's configurations")
    args = ap.parse_args()
    if args.memory_utilization is None:
        args.memory_utilization = 0.35 if args.mechanism == "sidp" else 0.9
    rows = read_jsonl(sharegpt_path(args.workload))[:args.requests]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"mechanism": args.mechanism, "card": card, "host": host_info(),
           "model": str(args.model), "requests": len(rows),
           "memory_utilization": None if args.kv else args.memory_utilization,
           "kv_cache_memory": args.kv}
    configs = configurations(args)
    for name in args.only or list(configs):
        strategy, parallel, sampling, device = configs[name]
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            out[name] = _run(args, _config(args, strategy, parallel, device), rows, sampling)
        except Exception as exc:  # noqa: BLE001 - one configuration's failure is its result
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        # each arm as it lands: a time limit that stops the script keeps the ones before
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    reference = args.mechanism              # its tok/s (and KV per replica) over each other's
    pairs = [(reference, name) for name in configs    # the one-rank arms are compared apart
             if name != reference and configs[name][1] == configs[reference][1]]
    pairs += [("sipipe-1rank", "sipipe-1rank-no-graphs"), ("sipipe-1rank", "baseline-1gpu")]
    for first, second in pairs:
        mine, theirs = out.get(first, {}), out.get(second, {})
        if "output_tok_per_s" in mine and "output_tok_per_s" in theirs:
            out[f"{first}_over_{second}"] = {
                key: round(mine[key] / theirs[key], 3)
                for key in ("output_tok_per_s", "kv_tokens_per_replica") if theirs.get(key)}
    emit(out)


if __name__ == "__main__":
    main()
