"""gLLM Token Throttling vs the pipeline baselines (PP+HB with Sarathi-Serve's fixed 2,048-token
budget, the paper's baseline, and PP+SB), with the ablations (w/o WT, w/o UT, w/o decode
throttling) and a sensitivity sweep of #T.

Workload and method: strategy_bench.py (ShareGPT prompts all submitted at time 0 as an offline
job, the same KV memory for every configuration, one fresh process each, PP=2 on 2 cores).

    python benchmarks/strategies/gllm_bench.py --requests 1000 --output-scale 0.25
    python benchmarks/strategies/gllm_bench.py --requests 200 --only gllm pp2-hb --repeat 3
    python benchmarks/strategies/gllm_bench.py --requests 300 --output-scale 0.5 --repeat 3 \
        --only gllm gllm-no-preemptive-metadata pp2-hb pp2-hb-metadata pp2-hb-ahead pp2-sb pp2-sb-metadata

Prints one JSON object; ratios are gLLM's output tok/s over each other configuration's.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.strategies.strategy_bench import main  # noqa: E402

GLLM = {"name": "gllm", "max_num_seqs": 512}        # the paper's #T 8, #MaxP 2048, #MinP 32, 0.05
CONFIGS = {
    "gllm": {"pp": 2, "strategy": GLLM},
    "pp2-hb": {"pp": 2, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                      "max_num_batched_tokens": 2048}},
    "pp2-sb": {"pp": 2, "strategy": {"name": "baseline", "policy": "sb", "max_num_seqs": 512}},
    "single-hb": {"pp": 1, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                         "max_num_batched_tokens": 2048}},
    "gllm-no-wt": {"pp": 2, "strategy": {**GLLM, "WT": False}},
    "gllm-no-ut": {"pp": 2, "strategy": {**GLLM, "UT": False}},
    "gllm-no-decode-throttling": {"pp": 2, "strategy": {**GLLM, "decode_throttling": False}},
    **{f"gllm-T{t}": {"pp": 2, "strategy": {**GLLM, "T": t}} for t in (1, 2, 4, 16, 32)},
    # the runtime (issue 41): preemptive metadata scheduling off (inputs prepared inline after
    # the receive); the baselines' stage transport as vLLM's (metadata) and with inputs ahead
    "gllm-no-preemptive-metadata": {"pp": 2, "strategy": {**GLLM, "preemptive_metadata": False}},
    "pp2-hb-metadata": {"pp": 2, "parallel": {"stage_transport": "metadata"},
                        "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                     "max_num_batched_tokens": 2048}},
    "pp2-sb-metadata": {"pp": 2, "parallel": {"stage_transport": "metadata"},
                        "strategy": {"name": "baseline", "policy": "sb", "max_num_seqs": 512}},
    "pp2-hb-ahead": {"pp": 2, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                           "max_num_batched_tokens": 2048, "prepare_ahead": True}},
}


if __name__ == "__main__":
    main(CONFIGS, "gllm", __doc__.splitlines()[0], str(Path(__file__).resolve()))
