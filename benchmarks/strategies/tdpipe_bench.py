"""TD-Pipe vs the pipeline baselines (PP+SB, PP+HB) and the single process, with the ablations.

Workload and method: strategy_bench.py (1,000 ShareGPT prompts at time 0, the same KV memory for
every configuration, one fresh process each). TD-Pipe's predictor is the oracle (max_tokens under
ignore_eos is the true length) unless --predictor says otherwise; tdpipe-<source> names its own
(with --stop-at-eos replies end at EOS and the forecasts are eos_workload.py's).
TP=2 runs a dummy-weight model of the same shape with 8 / 4 heads (SmolLM2's 9 / 3 do not split);
`tdpipe-dummy8` is TD-Pipe on that model, for the comparison.
With --share-step-times every TD-Pipe run after the first loads the first run's step-time table
instead of profiling its own (the intensity switch reads it: a forecast A/B is then not also an
A/B of start-up profiles). Each configuration runs in a fresh process; figures follow `vllm
bench throughput` (model load and TD-Pipe's startup profile excluded).

    python benchmarks/strategies/tdpipe_bench.py --requests 1000 --output-scale 0.25
    python benchmarks/strategies/tdpipe_bench.py --requests 200 --only tdpipe pp2-hb --repeat 3
    python benchmarks/strategies/tdpipe_bench.py --requests 120 --stop-at-eos --max-tokens 256 \
        --only tdpipe-bert-online tdpipe-bert tdpipe-oracle tdpipe-none pp2-hb --repeat 3 \
        --share-step-times
    python benchmarks/strategies/tdpipe_bench.py --requests 500 --output-scale 0.25 --only tdpipe \
        tdpipe-occupancy-30 tdpipe-occupancy-50 tdpipe-occupancy-70 tdpipe-occupancy-90

Prints one JSON object.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.strategies.strategy_bench import main  # noqa: E402

# TP=2 needs heads that divide by 2: a dummy-weight model of SmolLM2's shape with 8 / 4 heads
DUMMY8 = {"load_format": "dummy", "hf_overrides": {"num_attention_heads": 8,
                                                   "num_key_value_heads": 4, "head_dim": 64}}

TDPIPE = {"name": "tdpipe", "max_num_seqs": 512, "max_num_batched_tokens": 2048}
CONFIGS = {
    "tdpipe": {"pp": 2, "strategy": TDPIPE},
    "tdpipe-no-greedy-prefill": {"pp": 2, "strategy": {**TDPIPE, "greedy_prefill": False}},
    "tdpipe-no-work-stealing": {"pp": 2, "strategy": {**TDPIPE, "work_stealing": False}},
    "tdpipe-no-intensity": {"pp": 2, "strategy": {**TDPIPE, "intensity_switch": False}},
    "tdpipe-no-prefill-ahead": {"pp": 2, "strategy": {**TDPIPE, "launch_prefills_ahead": False}},
    "tdpipe-literal-forecast": {"pp": 2, "strategy": {**TDPIPE, "count_ending_requests": False}},
    "pp2-sb": {"pp": 2, "strategy": {"name": "baseline", "policy": "sb", "max_num_seqs": 512}},
    "pp2-hb": {"pp": 2, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                      "max_num_batched_tokens": 2048}},
    "single-hb": {"pp": 1, "strategy": {"name": "baseline", "policy": "hb", "max_num_seqs": 512,
                                         "max_num_batched_tokens": 2048}},
    "tdpipe-dummy8": {"pp": 2, "model": DUMMY8, "strategy": TDPIPE},
    "tp2-hb-dummy8": {"tp": 2, "model": DUMMY8, "strategy": {
        "name": "baseline", "policy": "hb", "max_num_seqs": 512, "max_num_batched_tokens": 2048}},
}
# TD-Pipe's forecasts from each source (Figs. 14-15: prediction error costs little); meant for
# --stop-at-eos, where lengths are unknown (eos_workload.py)
for _source in ("bert", "bert-online", "oracle", "mean", "none"):
    CONFIGS[f"tdpipe-{_source}"] = {"pp": 2, "strategy": TDPIPE, "predictor": _source}
    # admit_within_capacity's settings (default auto): Algorithm 1 as written, where the batch
    # that crosses the capacity is launched whole, and always holding such a prompt back
    for _suffix, _mode in (("as-written", False), ("within", True)):
        CONFIGS[f"tdpipe-{_source}-{_suffix}"] = {"pp": 2, "predictor": _source, "strategy": {
            **TDPIPE, "admit_within_capacity": _mode}}
# the upper forecast for the requests the predictor is unsure of (off by default since the
# forty-second session's four-job replay)
CONFIGS["tdpipe-bert-online-unsure-upper"] = {"pp": 2, "predictor": "bert-online", "strategy": {
    **TDPIPE, "unsure_upper_forecast": True}}
# preemption by swapping (memory.preemption_mode: swap) instead of the paper's recompute
for _source in ("bert-online", "oracle"):
    CONFIGS[f"tdpipe-{_source}-swap"] = {"pp": 2, "strategy": TDPIPE, "predictor": _source,
                                         "cache": {"preemption_mode": "swap"}}
# the paper's hyperparameter sweeps: Fig. 13 (switch to decode at a fixed KV occupancy instead of
# the greedy prefill) and Fig. 16 (switch to prefill at a fixed finished share instead of the
# intensity comparison)
for _pct in (30, 50, 70, 90):
    CONFIGS[f"tdpipe-occupancy-{_pct}"] = {"pp": 2, "strategy": {
        **TDPIPE, "greedy_prefill": False, "kv_occupancy_ratio": _pct / 100}}
for _pct in (10, 30, 50, 70, 90):
    CONFIGS[f"tdpipe-finished-{_pct}"] = {"pp": 2, "strategy": {
        **TDPIPE, "intensity_switch": False, "finished_ratio": _pct / 100}}


if __name__ == "__main__":
    main(CONFIGS, "tdpipe", __doc__.splitlines()[0], str(Path(__file__).resolve()))
