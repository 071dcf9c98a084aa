"""SiDP's decode iteration time against batch size in each mode (the paper's Fig. 11) on this CPU:
plain DP=2, SiDP WaS only and SiDP CaS only (B_th above every batch), in two situations:
- `tail`: one replica has all B requests, the other has run dry (the tail CaS is meant for);
- `even`: B requests on each replica.
Per (situation, B): the requests (the same ~30-token prompt, --output tokens each, greedy,
ignore_eos) all at time 0; iteration time = wall time / --output. SmolLM2-135M fp32, one core per
replica. One engine per configuration and repeat, configurations interleaved; medians over
--repeats. Also prints the B_th a default SiDP engine profiles at startup.

    python benchmarks/strategies/sidp_modes_bench.py --sizes 1 2 4 8 16 32 --output 32 --repeats 3

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402

PROMPT = ("Summarize the main differences between data parallelism and tensor parallelism for "
          "serving large language models, in three short bullet points.")
BATCHING = {"policy": "hb", "max_num_seqs": 256, "max_num_batched_tokens": 2048}
CONFIGS = {
    "dp2": {"name": "baseline", **BATCHING},
    "sidp-was": {"name": "sidp", "compute_service": False, **BATCHING},
    "sidp-cas": {"name": "sidp", "batch_threshold": 1_000_000, "mode_switch_patience": 1,
                 **BATCHING},
}
SITUATIONS = ("tail", "even")


def _engine(strategy: dict):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.runner.recipe import strategy_class

    params = strategy_class(strategy["name"]).model_validate(strategy)
    return Engine.from_config(EngineConfig(
        parallel={"dp": 2}, cache={"kv_cache_memory": "256MiB"}, model={"max_model_len": 1024},
        strategy=params, scheduler=params.scheduler_config()))


def _iteration_s(engine, situation: str, size: int, output: int, tag: str) -> float:
    from batchinfer.engine.request import Request, SamplingParams

    sampling = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPT)
    count = size if situation == "tail" else 2 * size
    for i in range(count):            # tail: all on replica 0, the other has run dry
        engine.add_request(Request(f"{tag}-{i}", ids, sampling),
                           replica=0 if situation == "tail" else None)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t0) / output


def run_config(strategy: dict, sizes: list[int], output: int) -> dict:
    out: dict = {s: {} for s in SITUATIONS}
    with _engine(strategy) as engine:
        engine.generate([PROMPT] * 2, None)                  # warm-up
        for situation in SITUATIONS:
            for size in sizes:
                out[situation][size] = _iteration_s(engine, situation, size, output,
                                                    f"{situation}{size}")
        out["mode_stats"] = {k: v for k, v in engine.stats().get("strategy_stats", {}).items()
                             if k in ("mode_switches", "mode_iterations", "cas_rounds")}
    return out


def profiled_threshold() -> dict:
    with _engine({"name": "sidp", **BATCHING}) as engine:
        info = engine.stats()["sidp"]
    costs = info["batch_threshold_costs"]
    return {"b_th": info["batch_threshold"],
            "ffn_path_ms": {"was": {b: round(t * 1e3, 2) for b, t in costs["was_s"].items()},
                            "cas": {b: round(t * 1e3, 2) for b, t in costs["cas_s"].items()}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name, strategy in CONFIGS.items():
            runs[name].append(run_config(strategy, args.sizes, args.output))
            print(f"repeat {repeat}: {name} done", flush=True)
    table: dict = {}
    for situation in SITUATIONS:
        table[situation] = {}
        for size in args.sizes:
            ms = {name: round(1e3 * statistics.median(r[situation][size] for r in runs[name]), 1)
                  for name in CONFIGS}
            table[situation][size] = {
                **{f"{name}_ms": v for name, v in ms.items()},
                "cas_vs_was_speedup": round(ms["sidp-was"] / ms["sidp-cas"], 3),
                "cas_vs_dp2": round(ms["dp2"] / ms["sidp-cas"], 3)}
    emit({"benchmark": "sidp_modes", "sizes": args.sizes, "output_tokens": args.output,
          "repeats": args.repeats, "iteration_ms_median": table,
          "mode_stats": {n: runs[n][-1]["mode_stats"] for n in CONFIGS},
          "profiled": profiled_threshold()})


if __name__ == "__main__":
    main()
