"""Decode throughput when another process keeps one of the job's CPUs busy, with every thread,
with one fewer, and with the engine's default (engine/cpu_load.py: it measures the CPUs at start
and takes a thread per free one).

    python benchmarks/engine/busy_core.py [--prompts 32] [--tokens 32] [--repeats 3]

Each case runs in a fresh process (the load is measured once per process): the embedded model,
W-decode's prompts, greedy, ignore_eos. The neighbour is a Python loop pinned to the last CPU
this process may use. Prints one JSON object: output tok/s per case (medians), and the threads
the default took.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, run_json, w_decode_prompts  # noqa: E402


def one_run(threads: int, prompts: int, tokens: int) -> dict:
    """This process: the engine (threads 0: the default) on the prompts -> JSON line."""
    import json

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    engine = Engine.from_config(EngineConfig(
        model={"max_model_len": 1024}, cache={"kv_cache_memory": "256MiB"},
        device={"num_threads": threads or None}))
    import torch

    texts = w_decode_prompts(None, prompts)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate(texts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    start = time.perf_counter()
    outs = engine.generate(texts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.output_token_ids) for o in outs)
    print(json.dumps({"threads": torch.get_num_threads(), "seconds": elapsed,
                      "tok_per_s": generated / elapsed}))


def _case(threads: int, args, busy_cpu: int = -1) -> dict:
    neighbour = None
    if busy_cpu >= 0:
        neighbour = subprocess.Popen([sys.executable, "-c",
                                      f"import os; os.sched_setaffinity(0, {{{busy_cpu}}})\n"
                                      "while True: pass"])
        time.sleep(0.5)
    try:
        runs = [run_json([sys.executable, __file__, "--one", str(threads), "--prompts",
                          str(args.prompts), "--tokens", str(args.tokens)],
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                for _ in range(args.repeats)]
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return {"threads": runs[0]["threads"],
            "tok_per_s": round(statistics.median(r["tok_per_s"] for r in runs), 1),
            "runs_tok_per_s": [round(r["tok_per_s"], 1) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        one_run(args.one, args.prompts, args.tokens)
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs")
    busy = cpus[-1]
    cases = {"idle_default": _case(0, args),
             "busy_all_threads": _case(len(cpus), args, busy),
             "busy_one_fewer": _case(len(cpus) - 1, args, busy),
             "busy_default": _case(0, args, busy)}
    emit({"prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats,
          "busy_cpu": busy, "cases": cases,
          "busy_all_over_one_fewer": round(cases["busy_all_threads"]["tok_per_s"]
                                           / cases["busy_one_fewer"]["tok_per_s"], 2),
          "busy_default_over_all": round(cases["busy_default"]["tok_per_s"]
                                         / cases["busy_all_threads"]["tok_per_s"], 2)})


if __name__ == "__main__":
    main()
