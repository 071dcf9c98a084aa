"""Shared harness of the strategy benchmarks (tdpipe_bench.py, gllm_bench.py, seesaw_bench.py,
sipipe_bench.py, sidp_bench.py; sim_fidelity.py runs its configurations through it too): the
workload, one configuration per fresh process, and the JSON they print. Not run by itself; its
users import it as benchmarks.strategies.strategy_bench.

Workload: the first N requests of the ShareGPT V3 sample (benchmarks/common.py: real ShareGPT V3
prompts; each request's max_tokens is its reference reply length x --output-scale, with
ignore_eos, so every configuration does the same work), greedy, all submitted at time 0.
SmolLM2-135M fp32 on both cores (one per rank under PP=2). Every configuration gets the same
total KV memory (--kv-tokens of the single process's token size; each PP rank holds its stage's
share), small enough that memory binds. The predictor (TD-Pipe reads it) is the oracle
(max_tokens under ignore_eos is the true length) unless --predictor mean (the workload's mean
length for all). Figures follow `vllm bench throughput` (model load and any startup profile
excluded). `--offset K` takes the requests after the first K (held-out prompts); `--stop-at-eos`
lets replies end at EOS (eos_workload.py: real reply lengths, unknown in advance; a configuration
may name its own `predictor`: oracle, mean, bert, none).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import bench_requests, emit, sharegpt_path  # noqa: E402
from benchmarks.strategies import eos_workload  # noqa: E402

TIMELINE_EVENTS = 2_000_000   # --dump / a timeline summary read every rank's events of the run


def kv_bytes_per_token(model: dict) -> int:
    """fp32 K and V of every layer (SmolLM2-135M: 30 layers, 3 kv heads of 64 -> 46,080 B)."""
    over = model.get("hf_overrides", {})
    return 30 * 2 * over.get("num_key_value_heads", 3) * over.get("head_dim", 64) * 4


def engine_config(spec: dict, kv_tokens: int, workload: str = "sharegpt"):
    """The EngineConfig of a configuration: every one gets the same KV memory (a rank's budget is
    its share of the single process's bytes; each data-parallel replica gets the whole)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.runner.recipe import strategy_class

    strategy = strategy_class(spec["strategy"]["name"]).model_validate(spec["strategy"])
    model = spec.get("model", {})
    ranks = spec.get("pp", 1) * spec.get("tp", 1)
    kv_bytes = kv_tokens * kv_bytes_per_token(model) // ranks
    return EngineConfig(model={"max_model_len": 4096 if workload == "prefill-heavy" else 2048,
                               **model},
                        cache={"kv_cache_memory": kv_bytes, **spec.get("cache", {})},
                        parallel={"pp": spec.get("pp", 1), "tp": spec.get("tp", 1),
                                  **spec.get("parallel", {})},
                        scheduler=strategy.scheduler_config(), strategy=strategy)


def workload_rows(n: int, scale: float, workload: str, offset: int = 0,
                  max_tokens: Optional[int] = None) -> list[dict]:
    """Requests offset .. offset + n of the workload; with `max_tokens` (the stop-at-EOS
    workload) that cap replaces the reference reply lengths."""
    rows = bench_requests(offset + n, scale, workload)[offset:]
    if max_tokens is not None:
        rows = [{**r, "max_tokens": max_tokens} for r in rows]
    return rows


def run_config(spec: dict, name: str, n: int, scale: float, kv_tokens: int, predictor: str,
               workload: str = "sharegpt", offset: int = 0, stop_at_eos: bool = False,
               max_tokens: int = 256, lengths_path: Optional[str] = None,
               step_times_path: Optional[str] = None, dump: Optional[str] = None) -> dict:
    """One configuration, inside a fresh process. `step_times_path`: a step-time table TD-Pipe
    loads instead of profiling at start-up. `dump`: a file prefix; the engine's step events go
    to PREFIX.steps.jsonl and the worker ranks' intervals (forward, send, ...) to
    PREFIX.timeline.jsonl."""
    from batchinfer.engine.engine import Engine
    from batchinfer.runner.report.micro_batch_tokens import MicroBatchTokens
    from batchinfer.engine.request import Request, SamplingParams
    from batchinfer.runner.predictor_setup import learn

    if step_times_path and spec["strategy"].get("name") == "tdpipe":
        spec = {**spec, "strategy": {**spec["strategy"], "step_times": step_times_path}}
    config = engine_config(spec, kv_tokens, workload)
    rows = workload_rows(n, scale, workload, offset, max_tokens if stop_at_eos else None)
    predictor = spec.get("predictor", predictor)
    lengths = json.loads(Path(lengths_path).read_text()) if lengths_path else None
    # the shipped predictor forecasts in the timed run, as a job's does (its cost counts)
    job_predictor = (eos_workload.job_predictor(online=predictor == "bert-online")
                     if predictor in ("bert", "bert-online") else None)
    online = job_predictor if predictor == "bert-online" else None
    predicted, predict_s = ([None] * len(rows), 0.0) if job_predictor else eos_workload.forecasts(
        predictor, rows, lengths)
    t_build = time.perf_counter()
    with Engine.from_config(config) as engine:
        build_s = time.perf_counter() - t_build
        if spec.get("timeline") or dump:     # a job keeps only what its report draws
            engine.keep_timeline(TIMELINE_EVENTS)
        tokens = [eos_workload.prompt_ids(engine.tokenizer, r["prompt"], stop_at_eos)
                  for r in rows]
        start = time.perf_counter()
        requests = []
        for i, (row, ids) in enumerate(zip(rows, tokens)):
            base = eos_workload.EOS_SAMPLING if stop_at_eos else {"temperature": 0.0}
            sampling = {**base, **spec.get("sampling", {})}
            if sampling["temperature"] > 0:
                sampling.setdefault("seed", i)
            request = Request(row["id"], ids, SamplingParams(max_tokens=row["max_tokens"],
                                                             ignore_eos=not stop_at_eos,
                                                             **sampling),
                              arrival_index=i)
            request.predicted_output_len = predicted[i]
            requests.append(request)
        if job_predictor is not None:   # as a job does: forecast at admission
            predicted, predict_s = eos_workload.job_forecasts(job_predictor, requests, rows)
        for request in requests:
            engine.add_request(request)
        outs, events = [], []
        while engine.has_unfinished():
            step_outs = engine.step()
            if online is not None:      # and learn after each step
                learn(online, engine, step_outs, time.perf_counter())
            outs.extend(step_outs)
            events.extend(engine.drain_step_events())
        elapsed = time.perf_counter() - start
        if online is not None:    # the forecasts TD-Pipe read last (the refits' re-forecasts)
            predicted = [request.predicted_output_len for request in requests]
        stats = engine.stats()
        sched = engine.scheduler
        timeline = (timeline_summary(engine.replicas[0].executor.timeline())
                    if spec.get("timeline") and hasattr(engine.replicas[0].executor, "timeline")
                    else None)
        if dump:
            _dump(dump, events, engine.replicas[0].executor)
    n_in = sum(o.num_prompt_tokens for o in outs)
    n_out = sum(o.num_output_tokens for o in outs)
    pipeline = stats.get("pipeline") or {}
    phase_s: dict[str, float] = {}
    for ev in events:
        phase_s[ev["phase"]] = phase_s.get(ev["phase"], 0.0) + ev["dur"]
    decode = [ev["num_seqs"] for ev in events if ev["phase"] == "decode"]
    balance = MicroBatchTokens()
    for ev in events:
        balance.add(ev["num_prefill_tokens"], ev["num_decode_tokens"], ev.get("replica", 0))
    actual = {o.request_id: o.num_output_tokens for o in outs}
    if stop_at_eos:
        eos = {"predictor": predictor, "predict_s": round(predict_s, 2),
               **({"online": online.stats()["online"]} if online is not None else {}),
               "forecast_error": eos_workload.forecast_error(predicted, actual, rows),
               "stopped_at_eos": sum(o.num_output_tokens < max_tokens for o in outs)}
        if lengths:
            eos["same_length_as_reference"] = round(statistics.mean(
                actual[k] == v for k, v in lengths.items() if k in actual), 3)
    return {"config": name, "requests": len(outs), "elapsed_s": round(elapsed, 2),
            "build_s": round(build_s, 1), **({"eos": eos} if stop_at_eos else {}),
            **({"lengths": actual} if name == "__reference__" else {}),
            "output_tok_per_s": round(n_out / elapsed, 1),
            "total_tok_per_s": round((n_in + n_out) / elapsed, 1),
            "requests_per_s": round(len(outs) / elapsed, 3),
            "prompt_tokens": n_in, "output_tokens": n_out,
            "kv_capacity_tokens": stats["kv_capacity_tokens"],
            "steps": stats["steps"], "preemptions": stats["num_preemptions"], "kv_swap": stats.get("kv_swap"),
            "phase_switches": getattr(sched, "num_switches", None),
            "mean_decode_batch": round(statistics.mean(decode), 1) if decode else None,
            "micro_batch_seconds_by_phase": {k: round(v, 1) for k, v in phase_s.items()},
            "bubble_ratio_by_stage": pipeline.get("bubble_ratio_by_stage"),
            "micro_batch_tokens": balance.summary(),
            "strategy_stats": stats.get("strategy_stats"),
            "step_times": stats.get("step_times"),
            **({"timeline": timeline} if timeline else {})}


def _dump(prefix: str, events: list[dict], executor) -> None:
    import jsonlines

    with jsonlines.open(f"{prefix}.steps.jsonl", "w") as out:
        out.write_all(events)
    if hasattr(executor, "timeline"):
        with jsonlines.open(f"{prefix}.timeline.jsonl", "w") as out:
            out.write_all(executor.timeline())


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds of the intervals `a` covered by the intervals `b` (each list sorted, b disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def timeline_summary(events: list[dict]) -> dict:
    """Per pipeline rank: medians per micro-batch of each recorded interval (forward, input
    preparation, receive wait, send) and the share of input preparation that overlapped that
    rank's forwards (SiPipe's token-safe execution hides it; inline it is 0); per sampler
    process: the median sampling time."""
    by_rank: dict[int, dict[str, list]] = {}
    for e in events:
        key = ("sampler " if e["stage"] < 0 else "rank ") + str(e["rank"])
        by_rank.setdefault(key, {}).setdefault(e["kind"], []).append((e["start"], e["end"]))
    out = {}
    for rank, kinds in sorted(by_rank.items()):
        row = {f"{kind}_ms_median": round(statistics.median(e - s for s, e in spans) * 1e3, 3)
               for kind, spans in kinds.items()}
        prepare, forward = sorted(kinds.get("prepare", [])), sorted(kinds.get("forward", []))
        prep_s = sum(e - s for s, e in prepare)
        if prep_s > 0:
            row["prepare_hidden_share"] = round(_overlap(prepare, forward) / prep_s, 3)
            row["prepare_s"] = round(prep_s, 2)
        if forward:
            row["forward_s"] = round(sum(e - s for s, e in forward), 2)
        out[rank] = row
    return out


def main(configs: dict, reference: str, description: str, script: str) -> None:
    """The command line of a strategy benchmark: each of `configs` (name -> {pp, tp, model,
    strategy}) in a fresh process running `script --worker NAME`; ratios are `reference`'s output
    tok/s over each other configuration's."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--output-scale", type=float, default=1.0,
                    help="multiply each reference reply length (1.0: ShareGPT's own lengths)")
    ap.add_argument("--kv-tokens", type=int, default=16384,
                    help="KV capacity of the single process in tokens; PP ranks split its bytes")
    ap.add_argument("--predictor", choices=["oracle", "mean", "bert", "bert-online", "none"], default="oracle",
                    help="the forecasts TD-Pipe reads, unless a configuration names its own")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip the first K requests of the sample (held-out prompts)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="replies end at EOS (chat template, repetition_penalty 1.1) with a cap "
                    "of --max-tokens; oracle / mean forecasts come from a reference pass")
    ap.add_argument("--max-tokens", type=int, default=256, help="--stop-at-eos: the cap")
    ap.add_argument("--lengths", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=["sharegpt", "prefill-heavy"], default="sharegpt",
                    help="prefill-heavy: ~1,500-token documents of joined ShareGPT prompts, "
                    "summaries of 1/16 of their tokens")
    ap.add_argument("--only", nargs="+", choices=sorted(configs), default=list(configs))
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each configuration (interleaved); medians are reported")
    ap.add_argument("--step-times", default=None,
                    help="a step-time table (JSON: report.json's engine.step_times, or a run's "
                    "step_times here) that every TD-Pipe configuration loads instead of profiling")
    ap.add_argument("--share-step-times", action="store_true",
                    help="every TD-Pipe run after the first loads the first one's measured table, "
                    "so an A/B of forecasts is not also an A/B of start-up profiles")
    ap.add_argument("--dump", default=None,
                    help="a folder: each run's step events and worker intervals as JSONL "
                    "(NAME-RUN.steps.jsonl, NAME-RUN.timeline.jsonl)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = (eos_workload.REFERENCE if args.worker == "__reference__"
                else configs[args.worker])
        print(json.dumps(run_config(spec, args.worker, args.requests, args.output_scale,
                                    args.kv_tokens, args.predictor, args.workload, args.offset,
                                    args.stop_at_eos, args.max_tokens, args.lengths,
                                    args.step_times, args.dump)))
        return
    workload = sharegpt_path()   # generated here once, before the workers read it
    common = ["--requests", str(args.requests), "--output-scale", str(args.output_scale),
              "--kv-tokens", str(args.kv_tokens), "--predictor", args.predictor, "--workload",
              args.workload, "--offset", str(args.offset)]
    lengths_path = None
    if args.stop_at_eos:
        if args.workload != "sharegpt":
            ap.error("--stop-at-eos runs the ShareGPT prompts (--workload sharegpt)")
        lengths_path = eos_workload.reference_lengths(script, args)
        common += ["--stop-at-eos", "--max-tokens", str(args.max_tokens),
                   "--lengths", str(lengths_path)]
    step_times = args.step_times
    runs: dict[str, list[dict]] = {name: [] for name in args.only}
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    for round_index in range(args.repeat):
        for name in args.only:
            extra = ["--step-times", step_times] if step_times else []
            if args.dump:
                extra += ["--dump", str(Path(args.dump).resolve() / f"{name}-{round_index}")]
            proc = subprocess.run([sys.executable, script, "--worker", name, *common, *extra],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                result = {"error": proc.stderr.strip().splitlines()[-3:]}
            else:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].append(result)
            if args.share_step_times and not step_times and result.get("step_times"):
                step_times = str(Path(tempfile.mkdtemp(prefix="strategy-bench-")) / "step_times.json")
                Path(step_times).write_text(json.dumps(result["step_times"]))
            print(json.dumps(result), file=sys.stderr, flush=True)
    results = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "output_tok_per_s" in r]
        if not ok:
            results[name] = rs[-1]
            continue
        median = statistics.median(r["output_tok_per_s"] for r in ok)
        results[name] = {**min(ok, key=lambda r: abs(r["output_tok_per_s"] - median)),
                         "output_tok_per_s_runs": [r["output_tok_per_s"] for r in ok],
                         "output_tok_per_s_median": median}
    ratios = {}
    ref = results.get(reference, {}).get("output_tok_per_s_median")
    for name, r in results.items():
        if ref and "output_tok_per_s_median" in r and name != reference:
            ratios[f"{reference}_vs_{name}"] = round(ref / r["output_tok_per_s_median"], 3)
    emit({"workload": str(workload), "kind": args.workload, "requests": args.requests,
          "output_scale": args.output_scale, "kv_tokens": args.kv_tokens,
          "predictor": args.predictor, "offset": args.offset,
          **({"stop_at_eos": {"max_tokens": args.max_tokens, "reference_lengths":
                              str(lengths_path)}} if args.stop_at_eos else {}),
          "repeat": args.repeat, "step_times": step_times, "ratios": ratios,
          "results": results})
