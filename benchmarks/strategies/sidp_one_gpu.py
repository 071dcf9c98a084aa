"""SiDP with both replicas on one GPU against plain DP=2 on that GPU, at the same memory (issue 40
item 3): KV tokens per replica, and output tok/s on ShareGPT requests in the memory-bound regime.

Both layouts run two worker processes on the one device (`parallel.gpu_transport: host`);
`memory.memory_utilization` (--memory-utilization) is the memory both may use: set low enough that
the two copies of the weights take most of it, the regime where the FFN memory SiDP frees pays.
SiDP's replicas read the one FFN store in place (its default on one GPU). One fresh engine each,
8 warm-up requests outside the timed window.

    python benchmarks/strategies/sidp_one_gpu.py --model examples/model-configs/llama-3.1-8b \
        --tokenizer DIR --workload sharegpt.jsonl --requests 500 --memory-utilization 0.35

On a CPU host (`--device cpu --kv 64MiB`: an explicit cache per rank) it runs the same code with
the host-staged transport's CPU test mode off: a dry run of the script, not a figure.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info, read_jsonl, sharegpt_path, timed_generate  # noqa: E402


def _config(args, strategy):
    from batchinfer.engine.config import EngineConfig

    model = {"path": str(args.model), "load_format": "dummy",
             **({"tokenizer": str(args.tokenizer)} if args.tokenizer else {}),
             **({"max_model_len": args.max_model_len} if args.max_model_len else {})}
    cache = ({"kv_cache_memory": args.kv} if args.kv
             else {"memory_utilization": args.memory_utilization})
    sections = {"model": model, "device": {"device": args.device}, "cache": cache,
                "parallel": {"dp": 2, "gpu_transport": "host"},
                "scheduler": {"max_num_seqs": args.max_num_seqs}}
    if strategy is not None:
        sections.update(strategy=strategy, scheduler=strategy.scheduler_config())
    return EngineConfig(**sections)


def _run(args, name: str, strategy, rows: list[dict]) -> dict:
    import torch

    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    start = time.perf_counter()
    engine = Engine.from_config(_config(args, strategy))
    built = time.perf_counter() - start
    try:
        engine.generate([r["prompt"] for r in rows[:8]],
                        SamplingParams(max_tokens=4, temperature=0.0))
        before = engine.stats()
        outs, elapsed, n_in, n_out = timed_generate(engine, rows)
        stats, info = engine.stats(), engine.info
    finally:
        engine.close()
    out = {"build_s": round(built, 1), "elapsed_s": round(elapsed, 2),
           "prompt_tokens": n_in, "output_tokens": n_out,
           "output_tok_per_s": round(n_out / elapsed, 1),
           "kv_tokens_per_replica": stats["kv_capacity_tokens"] // 2,
           "kv_cache_bytes": info.get("kv_cache_bytes"),
           "preemptions": stats["num_preemptions"] - before["num_preemptions"],
           "gpu_transport": info["parallel"].get("gpu_transport")}
    if name == "sidp":
        sidp = info["sidp"]
        out.update({key: sidp[key] for key in ("weight_slots", "ffn_store_bytes",
                                               "kv_capacity_vs_plain_dp", "batch_threshold")})
        summary = stats.get("strategy_stats", {})
        out["cas_iteration_share"] = summary.get("cas_iteration_share")
    del engine, outs
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    import torch

    from batchinfer.strategies.sidp.params import SiDPParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a config-only model directory")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer files, where the model has none")
    ap.add_argument("--workload", type=Path, help="JSONL of prompt / max_tokens rows "
                                                  "(default: the ShareGPT sample)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory-utilization", type=float, default=0.35)
    ap.add_argument("--kv", help="an explicit memory.kv_cache_memory per rank instead")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--only", nargs="+", choices=("dp2", "sidp"), default=["dp2", "sidp"])
    args = ap.parse_args()
    rows = read_jsonl(sharegpt_path(args.workload))[:args.requests]
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"card": card, "host": host_info(), "model": str(args.model), "requests": len(rows),
           "memory_utilization": None if args.kv else args.memory_utilization,
           "kv_cache_memory": args.kv}
    strategies = {"dp2": None, "sidp": SiDPParams(max_num_seqs=args.max_num_seqs)}
    for name in args.only:
        print(f"{name} ...", file=sys.stderr, flush=True)
        out[name] = _run(args, name, strategies[name], rows)
    if "dp2" in out and "sidp" in out:
        out["sidp_over_dp2"] = {
            "kv_tokens_per_replica": round(out["sidp"]["kv_tokens_per_replica"]
                                           / out["dp2"]["kv_tokens_per_replica"], 3),
            "output_tok_per_s": round(out["sidp"]["output_tok_per_s"]
                                      / out["dp2"]["output_tok_per_s"], 3)}
    emit(out)


if __name__ == "__main__":
    main()
