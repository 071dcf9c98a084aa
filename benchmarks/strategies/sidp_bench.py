"""SiDP vs plain DP=2 on this CPU, at the same memory per replica; WaS only vs WaS + CaS (Fig. 13).

Workload and method: strategy_bench.py (ShareGPT prompts at time 0, one fresh process per
configuration), greedy. --kv-tokens is plain DP's KV cache per replica; SiDP's replicas get the
same budget plus the FFN bytes they no longer hold. At the default 5,840 tokens (269 MB: the
per-replica budget is 1.5x SmolLM2-135M's 538 MB of fp32 weights) and full-length replies, KV
binds: the memory-bound regime of the paper.

    python benchmarks/strategies/sidp_bench.py --requests 100 --output-scale 1.0 --kv-tokens 5840
    python benchmarks/strategies/sidp_bench.py --requests 100 --output-scale 1.0 --kv-tokens 5840 \
        --only sidp-was-only sidp sidp-bth-16          # paper Fig. 13: WaS only vs WaS + CaS

`sidp` switches to CaS below the B_th it profiles at startup; `sidp-bth-16` below 16 whatever
the profile says (to see the tail in CaS here). `sidp` leaves `weight_slots` unset (in place on a
single-memory host); `sidp-slots` forces the paper's slot copies, `sidp-in-place` forbids them;
the ablations (`sidp-was-only`, `sidp-bth-16`, `sidp-no-peak-shifting`) keep the slots, as the
paper's WaS has them.

Prints one JSON object; the ratios are SiDP's output tok/s over each other configuration's, and
each result's kv_capacity_tokens is the engine's (both replicas).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.strategies.strategy_bench import main  # noqa: E402

BATCHING = {"policy": "hb", "max_num_seqs": 256, "max_num_batched_tokens": 2048}


def _dp2(name: str, **knobs) -> dict:
    return {"parallel": {"dp": 2}, "strategy": {"name": name, **knobs, **BATCHING}}


CONFIGS = {
    "sidp": _dp2("sidp"),
    "sidp-was-only": _dp2("sidp", compute_service=False, weight_slots=True),
    "sidp-bth-16": _dp2("sidp", batch_threshold=16, weight_slots=True),
    "dp2": _dp2("baseline"),
    "sidp-no-peak-shifting": _dp2("sidp", peak_shifting=False, weight_slots=True),
    "sidp-in-place": _dp2("sidp", weight_slots=False),
    "sidp-slots": _dp2("sidp", weight_slots=True),
}


if __name__ == "__main__":
    main(CONFIGS, "sidp", __doc__.splitlines()[0], str(Path(__file__).resolve()))
