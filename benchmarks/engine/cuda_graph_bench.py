"""CUDA graphs on a workload with continuous admissions: how many steps they cover, and the speed.

W-decode admits every request at once, so after the prefill every step is pure decode and
replays a graph. A real job admits new requests as others finish, so hybrid batching mixes their
prefill chunks into many steps, and those steps run eagerly (engine/cuda_graphs.py). This runs
the first --requests of the ShareGPT V3 sample (benchmarks/common.py: real ShareGPT V3 prompts,
each request's max_tokens its reference reply length, ignore_eos, greedy; --workload FILE for a
file of the same shape, as cuda_check.sh passes on a machine without the dataset) with
`device.cuda_graphs` on and off, each in a fresh process. The graphs' lazy capture happens inside
the timed run, as it would in a job, and is reported beside it.

    python benchmarks/engine/cuda_graph_bench.py --model DIR --load-format dummy --requests 600

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import (  # noqa: E402
    REPO, add_model_arguments, emit, model_section, read_jsonl, sharegpt_path)


def run(args, eager: bool) -> dict:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    engine = Engine.from_config(EngineConfig(
        model=model_section(args), scheduler={"max_num_seqs": args.max_num_seqs},
        device={"device": args.device, "cuda_graphs": not eager}))
    lines = read_jsonl(args.workload)[:args.requests]
    prompts = [r["prompt"] for r in lines]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in lines]
    engine.generate(prompts[:4], SamplingParams(max_tokens=2, temperature=0.0))
    engine.drain_step_events()
    graphs = engine.replicas[0].executor.graphs
    before = graphs.steps if graphs else 0
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    events = engine.drain_step_events()
    n_out = sum(o.num_output_tokens for o in outs)
    n_in = sum(o.num_prompt_tokens for o in outs)
    return {"cuda_graphs": not eager, "requests": len(outs), "elapsed_s": round(elapsed, 3),
            "output_tok_per_s": round(n_out / elapsed, 1),
            "total_tok_per_s": round((n_in + n_out) / elapsed, 1),
            "requests_per_s": round(len(outs) / elapsed, 2), "steps": len(events),
            "decode_only_steps": sum(1 for e in events if e["num_prefill_tokens"] == 0),
            **({"graph_steps": graphs.steps - before, "graphs": graphs.num_graphs,
                "graph_capture_s": round(graphs.capture_seconds, 2)} if graphs else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=None,
                    help="a JSONL request file with max_tokens (default: the ShareGPT V3 sample)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--worker", choices=["graphs", "eager"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run(args, eager=args.worker == "eager")))
        return
    args.workload = sharegpt_path(args.workload)
    report = {"workload": str(args.workload), "requests": args.requests}
    for mode in ("graphs", "eager"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--workload",
                               str(args.workload), "--worker", mode],
                              capture_output=True, text=True, cwd=REPO)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        report[mode] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
    if "output_tok_per_s" in report["graphs"] and "output_tok_per_s" in report["eager"]:
        report["graphs_vs_eager"] = round(report["graphs"]["output_tok_per_s"]
                                          / report["eager"]["output_tok_per_s"], 3)
    emit(report)


if __name__ == "__main__":
    main()
