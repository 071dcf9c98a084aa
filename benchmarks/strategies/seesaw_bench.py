"""Seesaw (PP=2 prefill -> TP=2 decode) vs the static layouts PP=2 and TP=2, each with its best
batching, on a prefill-heavy and a ShareGPT workload, with Seesaw's ablations.

TP=2 needs heads that divide by 2, so every configuration runs a dummy-weight model of SmolLM2's
shape with 8 / 4 heads (the same weights in every layout: they come from a seed). Workload,
KV sizing and method: strategy_bench.py (the same device KV bytes for every configuration; the
CPU store is Seesaw's own tier on top, --cpu-store-gib). Each configuration runs in a fresh
process; figures follow `vllm bench throughput` (model load excluded).

    python benchmarks/strategies/seesaw_bench.py --workload prefill-heavy --requests 40
    python benchmarks/strategies/seesaw_bench.py --workload sharegpt --requests 300 --output-scale 0.25
    python benchmarks/strategies/seesaw_bench.py --workload prefill-heavy --requests 40 --only seesaw \
        seesaw-pp2-only tp2-sb pp2-sb
    python benchmarks/strategies/seesaw_auto_pick.py --workload prefill-heavy --requests 16   # auto

Prints one JSON object.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.strategies.strategy_bench import main  # noqa: E402

DUMMY8 = {"load_format": "dummy", "hf_overrides": {"num_attention_heads": 8,
                                                   "num_key_value_heads": 4, "head_dim": 64}}
EVEN = {"pp_balance": "layers"}   # 15 + 15: a PP rank's KV shard is as big as a TP rank's
SEESAW = {"name": "seesaw", "decode_tp": 2, "decode_pp": 1, "cpu_kv_cache_memory": "4GiB"}


def _baseline(policy: str) -> dict:
    return {"name": "baseline", "policy": policy, "max_num_seqs": 512,
            "max_num_batched_tokens": 2048}


CONFIGS = {
    "seesaw": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": SEESAW},
    "pp2-sb": {"pp": 2, "model": DUMMY8, "strategy": _baseline("sb")},
    "pp2-hb": {"pp": 2, "model": DUMMY8, "strategy": _baseline("hb")},
    "tp2-sb": {"tp": 2, "model": DUMMY8, "strategy": _baseline("sb")},
    "tp2-hb": {"tp": 2, "model": DUMMY8, "strategy": _baseline("hb")},
    "seesaw-prefill-prioritizing": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "schedule": "prefill_prioritizing"}},
    "seesaw-decode-prioritizing": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "schedule": "decode_prioritizing"}},
    "seesaw-no-cpu-tier": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "cpu_kv_tier": False}},
    "seesaw-no-async": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "async_pipeline": False}},
    # c_d = c_p = PP=2: no re-sharding, the CPU tier and the transition-minimizing schedule only
    "seesaw-pp2-only": {"pp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "decode_tp": 1, "decode_pp": 2}},
    # the other two (c_p, c_d) pairs `prefill_layout: auto` chooses among (seesaw_auto_pick.py)
    "seesaw-tp2-tp2": {"tp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": SEESAW},
    "seesaw-tp2-pp2": {"tp": 2, "parallel": EVEN, "model": DUMMY8, "strategy": {
        **SEESAW, "decode_tp": 1, "decode_pp": 2}},
}


if __name__ == "__main__":
    main(CONFIGS, "seesaw", __doc__.splitlines()[0], str(Path(__file__).resolve()))
