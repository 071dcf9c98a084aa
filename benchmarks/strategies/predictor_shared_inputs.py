"""What the length predictor's forecast costs when prompts share what its encoder reads
(predictors/bert.py, `Tokenized.distinct`): real ShareGPT prompts as they are, and the same
prompts behind one long shared preamble (a few-shot or instruction header longer than the
encoder's 256 tokens, so under `head` truncation every prompt reads alike), each with the inputs
encoded once and with every prompt encoded (the ablation), round-robin.

    python benchmarks/strategies/predictor_shared_inputs.py --requests 120 --repeat 5

Prints JSON: per configuration the median seconds and the distinct encoder inputs, beside the
host's CPU model and flags. The predictor is the shipped one with the `auto` encoder.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info, sharegpt_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--preamble-chars", type=int, default=3000,
                    help="the shared header: this many characters of other ShareGPT prompts")
    args = ap.parse_args()

    import numpy as np

    from batchinfer.engine.model.sources import DEFAULT_MODEL_ID
    from batchinfer.predictors import bert
    from batchinfer.predictors.auto import shipped_predictor

    predictor = bert.BertLengthPredictor.load(shipped_predictor(DEFAULT_MODEL_ID), device="cpu",
                                              encoder_int8="auto", encoder_bf16_attention="auto")
    rows = sharegpt_rows()
    prompts = [r["prompt"] for r in rows[:args.requests]]
    header = " ".join(r["prompt"] for r in rows[args.requests:args.requests + 200])
    header = header[:args.preamble_chars]
    workloads = {"sharegpt": prompts,
                 "shared preamble": [f"{header}\n\nQuestion: {p}" for p in prompts]}
    distinct = bert.Tokenized.distinct
    every = (lambda self: (self, np.arange(len(self))))       # the ablation: no sharing
    runs = {(w, d): [] for w in workloads for d in ("distinct", "every prompt")}
    try:
        for _ in range(args.repeat):
            for workload, mode in runs:
                bert.Tokenized.distinct = distinct if mode == "distinct" else every
                start = time.perf_counter()
                predictor.features(workloads[workload])
                runs[(workload, mode)].append(time.perf_counter() - start)
    finally:
        bert.Tokenized.distinct = distinct
    results = {}
    for (workload, mode), times in runs.items():
        tokens = bert.Tokenized(predictor.tokenizer, workloads[workload], predictor.max_length)
        results[f"{workload}, {mode}"] = {
            "seconds_median": round(statistics.median(times), 3),
            "runs": [round(t, 3) for t in times],
            "encoder_inputs": len(tokens.distinct()[0]) if mode == "distinct" else len(tokens)}
    emit({"benchmark": "predictor_shared_inputs", "host": host_info(),
          "requests": args.requests, "preamble_chars": len(header),
          "encoder": predictor.describe()["encoder"], "results": results})


if __name__ == "__main__":
    main()
