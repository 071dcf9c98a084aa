"""What a decode step costs by the context its sequences read: the same number of sequences
decoding after prompts of different lengths (issue 43: TD-Pipe's step-time table is profiled at
one context length, and a decode step reads every cached token of its sequences).

    python benchmarks/engine/decode_context.py
    python benchmarks/engine/decode_context.py --sequences 10 --contexts 128 512 1024 --repeat 2

The embedded model in one process (fp32, the engine's defaults): per context length, `--sequences`
prompts of that many fresh tokens (no prefix shared) decode `--steps` tokens each (ignore_eos);
each engine step is timed and the median of the decode steps (the prefill steps and the first and
last few decode steps left out) is reported. Prints one JSON object: per context the median ms
per decode step (each repeat's), and its cost against the first context's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=10, help="sequences decoding together")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024],
                    help="prompt lengths (1-1900 tokens)")
    ap.add_argument("--steps", type=int, default=80, help="tokens each sequence decodes")
    ap.add_argument("--repeat", type=int, default=2, help="runs per context, interleaved")
    args = ap.parse_args()
    if args.sequences < 1 or args.steps < 20 or not all(1 <= c <= 1900 for c in args.contexts):
        ap.error("--sequences >= 1, --steps >= 20, contexts of 1-1900 tokens")

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import Request, SamplingParams

    config = EngineConfig(model={"max_model_len": 2048}, cache={"kv_cache_memory": 1024 << 20})
    sampling = SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=0.0)
    runs: dict[int, list[float]] = {c: [] for c in args.contexts}
    with Engine.from_config(config) as engine:
        vocab = engine.tokenizer.vocab_size
        run = 0
        for _ in range(args.repeat):
            for context in args.contexts:
                run += 1
                for i in range(args.sequences):
                    ids = [100 + (run * 7919 + i * 104729 + j * 31) % (vocab - 200)
                           for j in range(context)]
                    engine.add_request(Request(f"r{run}-{i}", ids, sampling))
                seconds = []
                while engine.has_unfinished():
                    start = time.perf_counter()
                    engine.step()
                    seconds.append(time.perf_counter() - start)
                decode = seconds[-(args.steps - 15):-5]    # past the prefill steps, before the end
                runs[context].append(round(1000 * statistics.median(decode), 2))
    first = statistics.median(runs[args.contexts[0]])
    results = [{"context": c, "ms_per_step": round(statistics.median(ms), 2), "runs": ms,
                "vs_first": round(statistics.median(ms) / first, 3)} for c, ms in runs.items()]
    emit({"benchmark": "decode_context", "host": host_info(), "sequences": args.sequences,
          "steps": args.steps, "repeat": args.repeat,
          "model": "embedded default (SmolLM2-135M-Instruct), fp32, one process",
          "results": results})


if __name__ == "__main__":
    main()
