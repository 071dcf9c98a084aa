"""KV layer groups under each strategy that runs them, on and off (issue 42): a Gemma-3-shaped
model whose windowed layers release the blocks behind their window, on long prompts in a KV
budget that binds.

`memory.free_outside_window: false` is the ablation, and what TD-Pipe, gLLM, SiPipe and Seesaw
ran with before they took the groups: one block table over every layer, so a request holds its whole
context in the windowed layers too. Both arms of a strategy get the same KV bytes; each
configuration runs in a fresh process; prompts are the prefill-heavy documents of joined ShareGPT
prompts (~1,500 tokens, past the 512-key window), each generating --max-tokens (ignore_eos, so
TD-Pipe's max_tokens forecast is exact and the two arms compute the same tokens).

    python benchmarks/engine/window_groups.py --requests 16 --max-tokens 384 --kv-requests 4 \
        --only tdpipe gllm       # docs/performance.md, 2026-11-29 (fortieth session)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import bench_requests, emit, host_info  # noqa: E402
from benchmarks.engine.model_shapes import shape_dir, shapes  # noqa: E402

SHAPE = "gemma3-1b-6l"
MAX_MODEL_LEN = 4096
STRATEGIES = {   # name -> (strategy section, pipeline stages)
    "baseline-hb": ({"name": "baseline", "policy": "hb", "max_num_batched_tokens": 512}, 1),
    "tdpipe": ({"name": "tdpipe", "max_num_batched_tokens": 2048}, 2),
    "gllm": ({"name": "gllm"}, 2),
    # the model's one kv head rules out TP, so c_d is c_p (no re-shard): the CPU tier still
    # takes every prompt's KV after prefill and gives it back for decode (store: STORE_RATIO x
    # the device bytes)
    "seesaw": ({"name": "seesaw", "decode_tp": 1, "decode_pp": 2,
                "max_num_batched_tokens": 2048}, 2),
}
STORE_RATIO = 2


def kv_bytes_per_token() -> int:
    """fp32 K and V of every layer of the shape (one table over every layer)."""
    from batchinfer.engine.model.arch import arch_from_dict

    return arch_from_dict(shapes()[SHAPE]).kv_bytes_per_token(4)


def run_one(strategy: str, free: bool, rows: list[dict], kv_bytes: int) -> dict:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import Request, SamplingParams
    from batchinfer.runner.recipe import strategy_class

    spec, pp = STRATEGIES[strategy]
    if spec["name"] == "seesaw":
        spec = {**spec, "cpu_kv_cache_memory": STORE_RATIO * kv_bytes}
    params = strategy_class(spec["name"]).model_validate(spec)
    config = EngineConfig(model={"path": str(shape_dir(SHAPE)), "load_format": "dummy",
                                 "max_model_len": MAX_MODEL_LEN},
                          cache={"kv_cache_memory": kv_bytes // pp,
                                 "free_outside_window": free},
                          parallel={"pp": pp}, scheduler=params.scheduler_config(),
                          strategy=params)
    t_build = time.perf_counter()
    with Engine.from_config(config) as engine:
        build_s = time.perf_counter() - t_build
        requests = [Request(row["id"], engine.tokenizer.encode(row["prompt"])[:MAX_MODEL_LEN // 2],
                            SamplingParams(max_tokens=row["max_tokens"], temperature=0.0,
                                           ignore_eos=True), arrival_index=i)
                    for i, row in enumerate(rows)]
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        outs, decode_batches = [], []
        while engine.has_unfinished():
            outs.extend(engine.step())
            decode_batches.extend(ev["num_seqs"] for ev in engine.drain_step_events()
                                  if ev["phase"] == "decode")
        elapsed = time.perf_counter() - start
        stats = engine.stats()
    n_out = sum(o.num_output_tokens for o in outs)
    return {"strategy": strategy, "free_outside_window": free, "requests": len(outs),
            "elapsed_s": round(elapsed, 1), "build_s": round(build_s, 1),
            "output_tok_per_s": round(n_out / elapsed, 2),
            "prompt_tokens": sum(o.num_prompt_tokens for o in outs), "output_tokens": n_out,
            "kv_groups": stats.get("kv_groups"), "kv_capacity_tokens": stats["kv_capacity_tokens"],
            "max_concurrency": stats.get("max_concurrency"),
            "window_freed_blocks": stats["kv_window_freed_blocks"],
            "preemptions": stats["num_preemptions"],
            "strategy_stats": {k: v for k, v in stats.get("strategy_stats", {}).items()
                               if k in ("num_switches", "swapped_out_tokens",
                                        "cpu_store_peak_tokens")} or None,
            "mean_decode_batch": round(statistics.mean(decode_batches), 1)
            if decode_batches else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--kv-requests", type=float, default=4.0,
                    help="KV bytes for this many requests of the prompt cap (max_model_len / 2) "
                         "+ max_tokens over one table of every layer")
    ap.add_argument("--only", nargs="+", choices=sorted(STRATEGIES), default=sorted(STRATEGIES))
    ap.add_argument("--worker", nargs=2, metavar=("STRATEGY", "FREE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [{**row, "max_tokens": args.max_tokens}
            for row in bench_requests(args.requests, 1.0, "prefill-heavy")]

    longest = MAX_MODEL_LEN // 2 + args.max_tokens
    kv_bytes = int(args.kv_requests * longest * kv_bytes_per_token())
    if args.worker:
        print(json.dumps(run_one(args.worker[0], args.worker[1] == "true", rows, kv_bytes)))
        return
    results = []
    for strategy in args.only:
        for free in (True, False):
            proc = subprocess.run([sys.executable, __file__, "--requests", str(args.requests),
                                   "--max-tokens", str(args.max_tokens), "--kv-requests",
                                   str(args.kv_requests), "--worker", strategy,
                                   "true" if free else "false"], capture_output=True, text=True)
            result = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                      else {"strategy": strategy, "free_outside_window": free,
                            "error": proc.stderr.strip().splitlines()[-3:]})
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
    ratios = {}
    for strategy in args.only:
        on, off = [next(r for r in results if r["strategy"] == strategy
                        and r["free_outside_window"] is free) for free in (True, False)]
        if "output_tok_per_s" in on and "output_tok_per_s" in off:
            ratios[strategy] = round(on["output_tok_per_s"] / off["output_tok_per_s"], 3)
    emit({"host": host_info(), "shape": SHAPE, "kv_cache_bytes": kv_bytes,
          "requests": args.requests, "max_tokens": args.max_tokens, "results": results,
          "groups_over_one_table": ratios})


if __name__ == "__main__":
    main()
