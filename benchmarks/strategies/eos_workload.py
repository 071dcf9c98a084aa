"""The strategy benchmarks' stop-at-EOS workload and its length forecasts (TD-Pipe Figs. 14-15).

Under ignore_eos every request's length is its max_tokens, so the oracle is free and a predictor
has nothing to add. Here requests stop at EOS as real jobs do: the embedded SmolLM2-135M-Instruct
answers real ShareGPT prompts through its chat template (greedy, repetition_penalty 1.1: the
sampling the shipped predictor's history was made with, benchmarks/strategies/predictor_history.yaml)
with a cap of --max-tokens, so lengths are unknown until the replies end. Forecasts:

- oracle: each reply's true length, from one reference pass of the single-process engine over
  the same requests (cached per workload; greedy, so a pipelined run generates the same replies
  up to floating-point ties: the share that matched is reported);
- mean: the reference lengths' mean for every request;
- bert: the predictor shipped for the embedded model (what `predictor: auto` picks), on the prompt
  text as a job gives it, its forecasts made inside the timed run as a job makes them;
- bert-online: the same predictor learning from the run as it goes (`predictor.online`, the
  default for a job): refits between steps on the finished replies, re-forecasts the rest;
- none: each request's max_tokens.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

EOS_SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.1}
REFERENCE = {"pp": 1, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 256,
                                   "max_num_batched_tokens": 2048}}


def prompt_ids(tokenizer, prompt: str, stop_at_eos: bool) -> list[int]:
    """The tokens a job gives the engine: through the chat template for the EOS workload (the
    instruct model answers, then stops), the raw prompt under ignore_eos."""
    if stop_at_eos:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def reference_path(n: int, offset: int, max_tokens: int, kv_tokens: int) -> Path:
    """Where the reference lengths are cached: per workload slice, cap and KV budget (in bf16 a
    preempted reply is re-prefilled through other kernels and may end elsewhere), per sampling
    and reference engine, and per host build: the native kernels loaded (their names change with
    the CPU's flags and the sources) and what `dtype: auto` may resolve to. A change to any makes
    a new entry; an engine change outside the kernels that alters greedy replies is not in the
    key: delete the entry (same_length_as_reference shows it). Reading the kernels' names loads
    them (building them once on a machine that has none yet)."""
    import hashlib
    import json

    from batchinfer.engine import envs
    from batchinfer.engine.kernels import loaded_kernel_builds
    from batchinfer.engine.setup_cache import cache_root

    auto_dtype = (envs.get("BATCHINFER_CPU_AUTO_DTYPE") or "").strip().lower()
    host = [sorted(loaded_kernel_builds()), auto_dtype]
    key = hashlib.sha256(json.dumps([EOS_SAMPLING, REFERENCE, kv_tokens, host],
                                    sort_keys=True).encode())
    return (cache_root() / "workloads" / f"sharegpt-eos-lengths-n{n}-off{offset}-max{max_tokens}"
            f"-{key.hexdigest()[:8]}.json")


def reference_lengths(script: str, args) -> Path:
    """The reference pass's {request id: output tokens}, run once per workload in a fresh process
    (`script --worker __reference__`) and cached."""
    path = reference_path(args.requests, args.offset, args.max_tokens, args.kv_tokens)
    if path.is_file():
        return path
    print(f"reference pass: {args.requests} requests to EOS on one process -> {path}",
          file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, script, "--worker", "__reference__", "--stop-at-eos",
                           "--requests", str(args.requests), "--offset", str(args.offset),
                           "--max-tokens", str(args.max_tokens), "--kv-tokens",
                           str(args.kv_tokens)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("the reference pass failed:\n" + proc.stderr[-2000:])
    lengths = json.loads(proc.stdout.strip().splitlines()[-1])["lengths"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(lengths))
    tmp.replace(path)
    return path


def forecasts(predictor: str, rows: list[dict], lengths: Optional[dict]) -> tuple[list, float]:
    """Each row's predicted output length (None: max_tokens) and the seconds predicting took."""
    import time

    if predictor == "none":
        return [None] * len(rows), 0.0
    if predictor == "bert":
        from batchinfer.engine.model.sources import DEFAULT_MODEL_ID
        from batchinfer.predictors.auto import shipped_predictor
        from batchinfer.predictors.base import LengthQuery
        from batchinfer.predictors.bert import BertLengthPredictor

        model = BertLengthPredictor.load(shipped_predictor(DEFAULT_MODEL_ID), device="cpu")
        t = time.perf_counter()
        out = model.predict([LengthQuery(r["prompt"], max_tokens=r["max_tokens"]) for r in rows])
        return out, time.perf_counter() - t
    if lengths is None:           # ignore_eos: max_tokens is the true length
        true = [r["max_tokens"] for r in rows]
    else:
        true = [lengths[r["id"]] for r in rows]
    if predictor == "mean":
        mean = round(statistics.mean(true))
        return [min(mean, r["max_tokens"]) for r in rows], 0.0
    return true, 0.0


def job_predictor(online: bool):
    """The shipped predictor as a job with `predictor: auto` builds it for the embedded model
    (the recipe's predictor defaults), learning from the run with `online`, without otherwise.
    Built before the timed run (a job builds it before the engine); its forecasts are made in
    the timed run (`job_forecasts`), as a job makes them at admission."""
    from batchinfer.engine.model.sources import DEFAULT_MODEL_ID
    from batchinfer.predictors import make_predictor
    from batchinfer.predictors.auto import shipped_predictor
    from batchinfer.runner.recipe import PredictorConfig
    from batchinfer.runner.predictor_setup import wrap_online

    cfg = PredictorConfig(name="bert", path=str(shipped_predictor(DEFAULT_MODEL_ID)),
                          online=online)
    return wrap_online(make_predictor(cfg, device="cpu"), cfg)


def job_forecasts(predictor, requests: list, rows: list[dict]) -> tuple[list, float]:
    """`job_predictor`'s forecasts (the online one's first), set on the requests as the job
    sets them; the prompt text is the row's, as a job gives it."""
    import time
    from types import SimpleNamespace

    from batchinfer.runner.predictor_setup import apply_forecast

    for request, row in zip(requests, rows):
        request.payload = SimpleNamespace(prompt_text=row["prompt"], predicted_tokens=None)
    t = time.perf_counter()
    forecasts = predictor.forecast(requests)
    for request, forecast in zip(requests, forecasts):
        apply_forecast(request, forecast)
    return [f.point for f in forecasts], time.perf_counter() - t


def forecast_error(predicted: list, actual: dict, rows: list[dict]) -> Optional[dict]:
    """How far the forecasts were from what the run generated: mean absolute error per request
    and the error of the total (Fig. 14's accumulated error with N = all)."""
    pairs = [(p if p is not None else r["max_tokens"], actual[r["id"]])
             for p, r in zip(predicted, rows) if r["id"] in actual]
    if not pairs:
        return None
    total = sum(a for _, a in pairs)
    return {"mean_abs_error_tokens": round(statistics.mean(abs(p - a) for p, a in pairs), 1),
            "total_error": round(abs(sum(p for p, _ in pairs) - total) / max(total, 1), 4)}
