"""One recipe, two commits, alternating in one invocation: is a change within the noise?

The base commit is checked out in a temporary git worktree; each side runs as a real `batchinfer
run` in a fresh process (bench/harness.py's run_bench: the order alternates every repeat) with
its own code on PYTHONPATH (an overlay laid out from that commit's pyproject package-dir map), so
the only difference between the sides is the code. One warm-up run per side first builds that
side's CPU kernels (cached per source) and is not counted. The figure is the median over repeats
of new / base output tok/s, each pair measured back to back.

    python benchmarks/engine/commit_ab.py --base c864d4d --repeats 5

Prints one JSON object (host, both sides' medians, the per-repeat ratios and their median).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import re
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO, emit, host_info  # noqa: E402


def overlay(tree: Path, into: Path) -> Path:
    """A directory whose `batchinfer` package is `tree`'s code, laid out as pyproject maps it."""
    text = (tree / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    mapping = dict(re.findall(r'^"?([\w.]+)"?\s*=\s*"([^"]+)"', section, re.M))
    root = into / "batchinfer"
    root.mkdir(parents=True)
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        if package == "batchinfer":
            for item in (tree / folder).iterdir():
                (root / item.name).symlink_to(item)
        else:
            (into / package.replace(".", "/")).symlink_to(tree / folder)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare the working tree with")
    ap.add_argument("--recipe", default="recipes/w-decode.yaml")
    ap.add_argument("--input", default="examples/w-decode.jsonl")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default=None, help="where the runs go (default: a temp dir)")
    args = ap.parse_args()

    from batchinfer.bench.harness import BenchConfig, run_bench, run_once

    work = Path(tempfile.mkdtemp(prefix="batchinfer-commit-ab-"))
    out = Path(args.output) if args.output else work / "bench"
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree),
                    args.base], check=True, capture_output=True)
    try:
        paths = {"base": overlay(base_tree, work / "site-base"),
                 "new": overlay(REPO, work / "site-new")}
        recipe, workload = (REPO / args.recipe).resolve(), (REPO / args.input).resolve()
        configs = [BenchConfig(name, recipe, "", "") for name in ("base", "new")]

        def runner(config: BenchConfig, data: Path, run_dir: Path) -> dict:
            return run_once(config, data, run_dir,
                            env={**os.environ, "PYTHONPATH": str(paths[config.name])})

        for config in configs:          # kernel builds and page cache: not counted
            warm = runner(config, workload, out / "warm" / config.name)
            if "error" in warm:
                raise SystemExit(f"{config.name}: {warm['error']}")
        result = run_bench(configs, workload, out, repeats=args.repeats, runner=runner)
        base_runs, new_runs = (row["output_tok_per_s_all"] for row in result["rows"])
        ratios = [round(n / b, 3) for n, b in zip(new_runs, base_runs) if n and b]
        emit({"base": args.base, "recipe": args.recipe, "input": args.input,
              "repeats": args.repeats, "host": host_info(),
              "rows": result["rows"], "new_over_base_per_repeat": ratios,
              "new_over_base_median": statistics.median(ratios) if ratios else None})
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                       capture_output=True)


if __name__ == "__main__":
    main()
