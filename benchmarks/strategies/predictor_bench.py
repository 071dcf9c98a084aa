"""The output-length predictor benchmark (issue 5): history -> 60/20/20 training -> test metrics.

    python benchmarks/strategies/predictor_bench.py --run   # (a) make the history with SmolLM2 first
    python benchmarks/strategies/predictor_bench.py         # (b, c) train + evaluate on an existing one

(a) `--run` runs `batchinfer run RECIPE --input PROMPTS --output RUN_DIR` (resumable: rerunning it
    continues); every finished request is appended to RUN_DIR/history.jsonl.
(b) trains the BERT classifier on that history (seeded 60/20/20 split) into OUT.
(c) prints JSON: test-split class accuracy and the majority-class baseline, accumulated error
    (TD-Pipe Fig. 14) at N = 1, 8, 32, 128, 256 for the predictor and for the mean predictor,
    inference time per request, and the predictor's share of the job time (one batched pass
    over every prompt of the history / the job's generation time).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO, emit  # noqa: E402


def make_history(recipe: Path, prompts: Path, run_dir: Path, limit: int | None) -> None:
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(recipe), "--input", str(prompts),
           "--output", str(run_dir), "--progress", "lines"]
    if limit:
        cmd += ["--limit", str(limit)]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        sys.exit(f"batchinfer run exited {done.returncode}")


def job_seconds(run_dir: Path) -> float | None:
    """Generation time of every session that wrote the run directory's history."""
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sessions = [report.get("session") or {}] + list(report.get("previous_sessions") or [])
    total = sum(float(s.get("generation_s") or 0.0) for s in sessions)
    return total or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="store_true", help="make (or continue) the history first")
    ap.add_argument("--recipe", type=Path,
                    default=Path(__file__).resolve().with_name("predictor_history.yaml"))
    ap.add_argument("--prompts", type=Path, default=REPO / "examples" / "predictor_prompts.jsonl")
    ap.add_argument("--run-dir", type=Path,
                    default=REPO / "runs" / "predictor_history__predictor_prompts")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "length_predictor")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (--run)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--train-layers", type=int, default=0)
    ap.add_argument("--pooling", default="cls", choices=("cls", "mean"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.run:
        make_history(args.recipe, args.prompts, args.run_dir, args.limit)

    from batchinfer.predictors.bert import BertLengthPredictor
    from batchinfer.predictors.history import read_history
    from batchinfer.predictors.train import TrainConfig, train_predictor

    data = read_history([args.run_dir], need_text=True)
    cfg = TrainConfig(seed=args.seed, epochs=args.epochs, train_layers=args.train_layers,
                      pooling=args.pooling, device=args.device)
    t = time.perf_counter()
    card = train_predictor(data.records, args.out, cfg, sources=[str(args.run_dir)],
                           skipped=dict(data.skipped)).card
    train_s = time.perf_counter() - t

    # inference cost as a job pays it: one batched pass over every prompt, freshly loaded
    predictor = BertLengthPredictor.load(args.out, device=args.device)
    t = time.perf_counter()
    predictor.predict_class_ids([r.prompt for r in data.records])
    infer_all_s = time.perf_counter() - t
    job_s = job_seconds(args.run_dir)

    test = card["metrics"]["test"]
    out = {
        "history": str(args.run_dir), "records": len(data.records),
        "skipped": dict(data.skipped), "models": card["data"]["models"],
        "split": card["data"]["split"],
        "classes": {"ranges": card["classes"]["ranges"], "means": card["classes"]["means"],
                    "train_counts": card["classes"]["train_counts"]},
        "test": {
            "records": test["records"],
            "class_accuracy": test["class_accuracy"],
            "majority_class_accuracy": test["majority_class_accuracy"],
            "accumulated_error": test["accumulated_error"],
            "mean_predictor_accumulated_error": test["mean_baseline_accumulated_error"],
            "mean_abs_error_tokens": test["mean_abs_error_tokens"],
            "confusion": test["confusion"],
        },
        "val_class_accuracy": card["metrics"]["val"]["class_accuracy"],
        "train_s": round(train_s, 2),
        "best_epoch": card["training"]["best_epoch"],
        "inference": {
            "requests": len(data.records), "seconds": round(infer_all_s, 3),
            "ms_per_request": round(1e3 * infer_all_s / max(len(data.records), 1), 4),
            "job_generation_s": job_s,
            "share_of_job": round(infer_all_s / job_s, 6) if job_s else None,
        },
        "predictor_dir": str(args.out),
        "config": {"epochs": args.epochs, "train_layers": args.train_layers,
                   "pooling": args.pooling, "seed": args.seed},
    }
    emit(out, indent=2)


if __name__ == "__main__":
    main()
