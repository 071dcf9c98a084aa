"""What a prefill costs per token by the length of its sequences: the same number of prompt tokens
as many short sequences or as one long one (issue 43: TD-Pipe's step-time table is profiled on
256-token prompts, and a preempted request is recomputed as one sequence of its prompt and every
token it had generated).

    python benchmarks/engine/prefill_shape.py
    python benchmarks/engine/prefill_shape.py --shapes 4x256 1x1024 1x800 --repeat 5

The embedded model in one process (fp32, the engine's defaults), each shape prefilled with
max_tokens 1 (one decode step besides) on fresh token ids every run, so no prefix is shared;
prints one JSON object: per shape the median seconds and milliseconds per prompt token, and
each shape's per-token cost against the first shape's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    try:
        count, length = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a shape as SEQUENCESxTOKENS, e.g. 4x256")
    if count < 1 or not 1 <= length <= 2000:
        raise argparse.ArgumentTypeError(f"{text!r}: 1 or more sequences of 1-2000 tokens")
    return count, length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", type=shape, nargs="+",
                    default=[shape(s) for s in ("4x256", "2x512", "1x1024", "1x800", "3x256")])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per shape (median)")
    args = ap.parse_args()

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    config = EngineConfig(model={"max_model_len": 2048}, cache={"kv_cache_memory": 512 << 20})
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    results = []
    with Engine.from_config(config) as engine:
        vocab = engine.tokenizer.vocab_size
        run = 0

        def prompts(count: int, length: int) -> list[list[int]]:
            nonlocal run
            run += 1
            return [[100 + (run * 7919 + i * 104729 + j * 31) % (vocab - 200)
                     for j in range(length)] for i in range(count)]

        for count, length in args.shapes:
            engine.generate(prompts(count, length), sampling)          # warm-up
            seconds = []
            for _ in range(args.repeat):
                batch = prompts(count, length)
                start = time.perf_counter()
                engine.generate(batch, sampling)
                seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds)
            results.append({"shape": f"{count}x{length}", "tokens": count * length,
                            "seconds": round(median, 4),
                            "ms_per_token": round(1000 * median / (count * length), 3)})
    first = results[0]["ms_per_token"]
    for row in results:
        row["vs_first"] = round(row["ms_per_token"] / first, 3)
    emit({"benchmark": "prefill_shape", "host": host_info(), "repeat": args.repeat,
          "model": "embedded default (SmolLM2-135M-Instruct), fp32, one process",
          "results": results})


if __name__ == "__main__":
    main()
