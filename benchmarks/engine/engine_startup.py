"""How long a multi-process engine takes to start, the first time in a process and after: workers
forked from the fork server (engine/runtime/fork_server.py, the default) against a fresh
interpreter per rank (multiprocessing's spawn), each in a process of its own, same invocation.

    python benchmarks/engine/engine_startup.py [--layout dp2|pp2|tp2] [--engines 3] [--repeats 3]

Prints one JSON object: per start method, the median seconds of the first start and of the
later ones (Engine.from_config until it returns: tokenizer, plan, workers ready, weights loaded).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, run_json  # noqa: E402

LAYOUTS = {"dp2": {"dp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}


def _worker(layout: str, engines: int, method: str) -> None:
    import json

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.runtime import pool

    if method == "spawn":     # the ablation: what every engine paid before the fork server
        import multiprocessing as mp

        pool._context = lambda: mp.get_context("spawn")
    starts = []
    for _ in range(engines):
        t0 = time.perf_counter()
        engine = Engine.from_config(EngineConfig(
            parallel=LAYOUTS[layout], cache={"kv_cache_memory": "64MiB"},
            model={"max_model_len": 512}))
        starts.append(time.perf_counter() - t0)
        engine.close()
    print(json.dumps({"starts_s": starts}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2")
    ap.add_argument("--engines", type=int, default=3, help="engines started one after another")
    ap.add_argument("--repeats", type=int, default=3, help="processes per start method")
    ap.add_argument("--worker", nargs=2, metavar=("LAYOUT", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker[0], args.engines, args.worker[1])
        return
    runs: dict[str, list[list[float]]] = {"forkserver": [], "spawn": []}
    for _ in range(args.repeats):
        for method in runs:          # alternate, so drift hits both alike
            out = run_json([sys.executable, __file__, "--engines", str(args.engines),
                            "--worker", args.layout, method])
            runs[method].append(out["starts_s"])
    result = {"layout": args.layout, "engines_per_process": args.engines,
              "repeats": args.repeats}
    for method, starts in runs.items():
        result[method] = {
            "first_start_s": round(statistics.median(s[0] for s in starts), 2),
            "later_start_s": round(statistics.median(x for s in starts for x in s[1:]), 2)
            if args.engines > 1 else None,
            "runs": [[round(x, 2) for x in s] for s in starts]}
    emit(result)


if __name__ == "__main__":
    main()
