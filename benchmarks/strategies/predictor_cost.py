"""What the length predictor's encoder costs a job (issue 43: under 1% of the job's time), on real
ShareGPT prompts, with each part of its input policy on and off in one invocation.

    python benchmarks/strategies/predictor_cost.py --requests 120 --repeat 3
    python benchmarks/strategies/predictor_cost.py --requests 120 --job-seconds 160 \
        --only "256, padded budget" "256, padded budget, int8 encoder, bf16 attention"

Configurations (timing only, all with the shipped predictor's head; the encoder's input, its
last layer and the arithmetic of its linears and attention change; the residual add and
LayerNorm run in the native kernel in all of them where the kernels load):

- `512, 64 rows, full last layer`: the encoder reads 512 tokens, batches of 64 prompts sorted by
  length, every token through the last layer (the first predictor);
- `512, padded budget, full last layer`: batches bounded by their padded tokens
  (bert.PADDED_TOKENS_PER_BATCH);
- `256, padded budget, full last layer`: the shipped predictor's input (it reads 256 tokens);
- `256, padded budget`: as a job runs it in fp32, the last layer computed at [CLS] alone
  (predictors/cls_encoder.py);
- `256, padded budget, bf16 attention`: attention in the bf16 kernel over the prompts' own tokens
  (`predictor.encoder_bf16_attention: auto`; skipped where the CPU lacks AVX512-BF16 or has AMX);
- `256, padded budget, int8 encoder`: the linears int8 (`predictor.encoder_int8: auto`, the GELU
  fused into the first feed-forward linear; skipped where the CPU lacks AVX512-VNNI), attention
  fp32;
- `256, padded budget, int8 encoder, bf16 attention`: both, as a job runs it on a CPU with both.

Prints JSON: per configuration the median seconds over `--repeat` rounds, each round one pass of
every configuration in turn (every prompt through the encoder and the head, as a job's admission
does), ms per request, encoder tokens and padded tokens, and the speed against the first
configuration run; with `--job-seconds` (e.g. a TD-Pipe run's elapsed time on the same prompts) each one's
share of that job. The host's CPU model and flags are printed beside the figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info, sharegpt_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="these configurations alone (their names as printed)")
    ap.add_argument("--job-seconds", type=float, default=None,
                    help="the job's time on these prompts, for the predictor's share of it")
    args = ap.parse_args()

    import torch

    from batchinfer.engine.model.sources import DEFAULT_MODEL_ID
    from batchinfer.predictors import bert
    from batchinfer.predictors.auto import shipped_predictor
    from batchinfer.predictors.cls_encoder import bidirectional_attention_missing

    budget = bert.PADDED_TOKENS_PER_BATCH
    shipped = budget["cpu"]
    # (tokens read, padded-token budget, int8 encoder, last layer at [CLS] alone, bf16 attention)
    configs = {"512, 64 rows, full last layer": (512, None, False, False, False),
               "512, padded budget, full last layer": (512, shipped, False, False, False),
               "256, padded budget, full last layer": (256, shipped, False, False, False),
               "256, padded budget": (256, shipped, False, True, False),
               "256, padded budget, bf16 attention": (256, shipped, False, True, True),
               "256, padded budget, int8 encoder": (256, shipped, True, True, False),
               "256, padded budget, int8 encoder, bf16 attention": (256, shipped, True, True, True)}
    unknown = sorted(set(args.only or ()) - set(configs))
    if unknown:
        ap.error(f"--only: no configuration {', '.join(map(repr, unknown))}; there are "
                 f"{', '.join(map(repr, configs))}")
    configs = {k: v for k, v in configs.items() if not args.only or k in args.only}
    path = shipped_predictor(DEFAULT_MODEL_ID)
    predictor = bert.BertLengthPredictor.load(path, device="cpu")
    no_int8 = bert.encoder_int8_missing(torch.device("cpu"))
    wants_int8 = any(c[2] for c in configs.values())
    quantized = (bert.BertLengthPredictor.load(path, device="cpu", encoder_int8=True)
                 if wants_int8 and not no_int8 else None)
    no_bf16_attention = bidirectional_attention_missing(predictor.model.encoder, torch.device("cpu"))
    texts = [r["prompt"] for r in sharegpt_rows()[args.offset:args.offset + args.requests]]
    results: dict[str, dict] = {}
    runs: dict[str, list[float]] = {}
    for name, (_, _, int8, _, bf16_attention) in configs.items():
        if (int8 and no_int8) or (bf16_attention and no_bf16_attention):
            results[name] = {"skipped": no_int8 if int8 and no_int8 else no_bf16_attention}
        else:
            runs[name] = []
    try:
        # rounds of every configuration in turn: this host's speed drifts by a quarter over
        # minutes, which would otherwise land on whichever configuration ran then
        for _ in range(args.repeat):
            for name in runs:
                max_length, cpu_budget, int8, cls_alone, bf16_attention = configs[name]
                chosen = quantized if int8 else predictor
                chosen.model.kernels = dataclasses.replace(chosen.model.kernels,
                                                           bf16_attention=bf16_attention)
                chosen.model.reads_cls_alone = cls_alone
                chosen.max_length = max_length
                budget["cpu"] = cpu_budget
                t = time.perf_counter()
                chosen.features(texts)
                runs[name].append(time.perf_counter() - t)
    finally:
        budget["cpu"] = shipped
    for name, times in runs.items():
        max_length, cpu_budget = configs[name][:2]
        tokens = bert.Tokenized(predictor.tokenizer, texts, max_length)
        padded = sum(len(b) * int(tokens.lengths[b].max())
                     for b in tokens.sorted_batches(predictor.batch_size, cpu_budget))
        seconds = statistics.median(times)
        results[name] = {
            "seconds_median": round(seconds, 3), "runs": [round(r, 3) for r in times],
            "ms_per_request": round(1e3 * seconds / len(texts), 2),
            "encoder_tokens": int(tokens.lengths.sum()), "padded_tokens": padded,
            **({"share_of_job": round(seconds / args.job_seconds, 4)}
               if args.job_seconds else {})}
    results = {name: results[name] for name in configs}
    first = next((r["seconds_median"] for r in results.values() if "seconds_median" in r), None)
    for r in results.values():
        if "seconds_median" in r:
            r["speedup_vs_first"] = round(first / r["seconds_median"], 2)
    emit({"benchmark": "predictor_cost", "host": host_info(),
          "torch_threads": torch.get_num_threads(),
          "workload": f"ShareGPT V3 sample [{args.offset}, {args.offset + len(texts)}), "
                      "the prompt text as a job gives it",
          "requests": len(texts), "repeat": args.repeat, "results": results,
          "accuracy": "not measured here: `batchinfer predictor eval` (docs/performance.md)"})


if __name__ == "__main__":
    main()
