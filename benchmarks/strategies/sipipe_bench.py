"""SiPipe vs the PP=2 baseline end to end on this CPU, with the paper's ablations (§7.5).

Workload and method: strategy_bench.py (ShareGPT prompts at time 0, the same KV memory for every
configuration, one fresh process each), with SiPipe's evaluation sampling: temperature 0.8,
top-k 50, top-p 0.9, min-p 0.05 and the repetition, frequency and presence penalties, seeded per
request so every configuration samples the same tokens. Each result carries the timeline summary:
per rank the median forward / input preparation / receive wait / send per micro-batch and the
share of input preparation hidden behind the forward; per sampler process the median sampling
time.

    python benchmarks/strategies/sipipe_bench.py --requests 200 --output-scale 0.25

Prints one JSON object; the ratios are SiPipe's output tok/s over each other configuration's.
This machine has 2 cores and PP=2 keeps both busy: the sampler processes and the input threads
compete with the forwards for the same cores (SiPipe's gains come from idle cores beside busy
GPUs), so small or negative effects are expected here.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import SIPIPE_SAMPLING  # noqa: E402
from benchmarks.strategies.strategy_bench import main  # noqa: E402

BATCHING = {"policy": "hb", "max_num_seqs": 256, "max_num_batched_tokens": 2048}
SIPIPE = {"name": "sipipe", **BATCHING}
CONFIGS = {
    "sipipe": {"pp": 2, "strategy": SIPIPE},
    "pp2-hb": {"pp": 2, "strategy": {"name": "baseline", **BATCHING}},
    "sipipe-no-cpu-sampling": {"pp": 2, "strategy": {**SIPIPE, "cpu_sampling": False}},
    "sipipe-no-column-split": {"pp": 2, "strategy": {**SIPIPE, "split_columns": False}},
    "sipipe-no-token-safe": {"pp": 2, "strategy": {**SIPIPE, "token_safe_execution": False}},
    "sipipe-no-structure-aware": {"pp": 2, "strategy": {
        **SIPIPE, "structure_aware_transmission": False}},
    "sipipe-all-off": {"pp": 2, "strategy": {
        **SIPIPE, "cpu_sampling": False, "token_safe_execution": False,
        "structure_aware_transmission": False}},
}
for _config in CONFIGS.values():
    _config.update(sampling=SIPIPE_SAMPLING, timeline=True)


if __name__ == "__main__":
    main(CONFIGS, "sipipe", __doc__.splitlines()[0], str(Path(__file__).resolve()))
