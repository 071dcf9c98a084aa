"""SiDP's KV capacity per replica vs plain DP=2 at the same memory per replica (no requests run).

The per-replica budget is --ratios x SmolLM2-135M's fp32 weights; plain DP gets the rest as KV
cache (cache.kv_cache_memory), SiDP the same plus the FFN bytes each replica no longer holds
(with its d - 1 weight slots, and in place without them).

    python benchmarks/strategies/sidp_capacity.py [--ratios 1.5 1.4]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit  # noqa: E402


def main() -> None:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.sidp.params import SiDPParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.5, 1.4])
    args = ap.parse_args()
    configs = {"dp2": None, "sidp": SiDPParams(weight_slots=True),
               "sidp-in-place": SiDPParams(weight_slots=False)}
    results, weights = [], None
    for ratio in args.ratios:
        row = {"budget_over_weights": ratio}
        for name, strategy in configs.items():
            if weights is None:        # learn the weight bytes from a first (plain) engine
                with Engine.from_config(EngineConfig(cache={"kv_cache_memory": "16MiB"},
                                                     model={"max_model_len": 256})) as e:
                    weights = e.info["num_params"] * 4
            sections = {"cache": {"kv_cache_memory": int(weights * (ratio - 1))},
                        "model": {"max_model_len": 2048}, "parallel": {"dp": 2}}
            if strategy is not None:
                sections.update(strategy=strategy, scheduler=strategy.scheduler_config())
            with Engine.from_config(EngineConfig(**sections)) as engine:
                row[f"{name}_kv_tokens_per_replica"] = engine.stats()["kv_capacity_tokens"] // 2
        for name in ("sidp", "sidp-in-place"):
            row[f"{name}_vs_dp2"] = round(row[f"{name}_kv_tokens_per_replica"]
                                          / row["dp2_kv_tokens_per_replica"], 3)
        results.append(row)
    emit({"fp32_weight_bytes": weights, "results": results})


if __name__ == "__main__":
    main()
