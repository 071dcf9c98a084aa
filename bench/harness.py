"""`batchinfer bench`: one workload through several configurations, one comparison table.

A configuration is a recipe (strategy, layout, backend); `--vllm-python` adds the first recipe
with strategy vllm under that Python. Each run is a real `batchinfer run` in a fresh process
into its own run directory; repetitions alternate the order (forward, then backward) so drift
on a noisy machine falls on every configuration alike, and the table shows medians. Figures are
the run report's, as `vllm bench throughput` counts them: tokens over the generation window,
model load excluded. A configuration that fails is reported as failed; the others go on.
"""
from __future__ import annotations

import dataclasses
import logging
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import yaml

from batchinfer.engine.cpu_load import busy_text
from batchinfer.engine.errors import ConfigError
from batchinfer.runner.recipe import load_recipe

log = logging.getLogger("batchinfer")
METRICS = ("output_tok_per_s", "total_tok_per_s", "requests_per_s")


@dataclasses.dataclass
class BenchConfig:
    name: str
    recipe_path: Path
    strategy: str
    layout: str


def parse_configs(specs: list[str], out_dir: Path,
                  vllm_python: Optional[str] = None) -> list[BenchConfig]:
    """`recipe.yaml` or `name=recipe.yaml` each; every recipe is validated before anything runs."""
    configs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        recipe = load_recipe(path)
        model_path = recipe.model.path
        if model_path and not Path(model_path).expanduser().exists():
            raise ConfigError(f"{path}: model.path {model_path!r} does not exist; give a Hugging "
                              "Face model directory, a .gguf file, or leave it empty for the "
                              "embedded default")
        configs.append(BenchConfig(name, Path(path), recipe.strategy.name, _layout(recipe)))
    if vllm_python:
        if not configs:
            raise ConfigError("--vllm-python compares vLLM with a recipe: name one")
        first = load_recipe(configs[0].recipe_path)
        data = first.model_dump(mode="json")
        data["strategy"] = {"name": "vllm", "python": vllm_python,
                            "max_num_seqs": first.strategy.scheduler_config().max_num_seqs}
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "vllm.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        configs.append(BenchConfig("vllm", path, "vllm", _layout(first)))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"configuration names must differ: {names}; name them name=recipe.yaml")
    if not configs:
        raise ConfigError("name at least one recipe to benchmark")
    return configs


def _layout(recipe) -> str:
    p = recipe.parallel
    return f"tp{p.tp} pp{p.pp} dp{p.dp}"


def check_fresh_output(out_dir: Path) -> None:
    """ConfigError where `out_dir` holds an earlier bench (its table or a run): every run starts
    fresh, and the earlier results are not replaced. Called before anything is written."""
    runs = out_dir / "runs"
    held = [p for p in (out_dir / "bench.json", out_dir / "bench.md") if p.is_file()]
    if runs.is_dir():
        held += [d for d in sorted(runs.iterdir()) if d.is_dir() and any(d.iterdir())]
    if held:
        raise ConfigError(f"{out_dir} holds an earlier bench ({held[0]}); give another --output "
                          "or remove it")


def run_once(config: BenchConfig, workload: Path, run_dir: Path,
             env: Optional[dict] = None) -> dict:
    """One `batchinfer run` in a fresh process (env: its environment, default this one's) ->
    its report's figures."""
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(config.recipe_path), "--input",
           str(workload), "--output", str(run_dir), "--no-resume", "--progress", "off", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    report_path = run_dir / "report.json"
    if proc.returncode not in (0, 1) or not report_path.is_file():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    result = figures(json.loads(report_path.read_text()))
    if not result["requests"] or result["output_tok_per_s"] is None:
        # per-request errors do not fail a job: a run that completed none measured nothing
        return {"error": f"no request completed ({result['failed'] or 0} failed: "
                         f"{run_dir / 'errors.jsonl'})"}
    return result


def figures(report: dict) -> dict:
    session, engine = report.get("session") or {}, report.get("engine") or {}
    rate = session.get("throughput") or {}
    stages = ((session.get("pipeline") or {}).get("bubble_ratio_by_stage") or {}).values()
    return {"output_tok_per_s": rate.get("output_tokens_per_s"),
            "total_tok_per_s": rate.get("total_tokens_per_s"),
            "requests_per_s": rate.get("requests_per_s"),
            "bubble_ratio": round(statistics.mean(stages), 4) if stages else None,
            "kv_capacity_tokens": engine.get("kv_capacity_tokens"),
            "requests": session.get("requests_completed"),
            "failed": session.get("requests_failed"),
            "generation_s": session.get("generation_s")}


def check_baseline(configs: list[BenchConfig], baseline: Optional[str]) -> str:
    """The configuration the others are compared with (--baseline; default the first)."""
    baseline = baseline or configs[0].name
    if baseline not in {c.name for c in configs}:
        raise ConfigError(f"--baseline {baseline!r} is not one of "
                          f"{', '.join(c.name for c in configs)}")
    return baseline


def run_bench(configs: list[BenchConfig], workload: Path, out_dir: Path, repeats: int = 3,
              baseline: Optional[str] = None,
              runner: Callable[[BenchConfig, Path, Path], dict] = run_once,
              on_run: Callable[[str, int, dict], None] = lambda *_: None) -> dict:
    if repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    baseline = check_baseline(configs, baseline)
    check_fresh_output(out_dir)
    host = bench_host()
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for rep in range(repeats):
        for config in (configs if rep % 2 == 0 else configs[::-1]):
            result = runner(config, workload, out_dir / "runs" / f"{config.name}-{rep}")
            runs[config.name].append(result)
            on_run(config.name, rep, result)
    rows = [_row(c, runs[c.name]) for c in configs]
    base = next(r for r in rows if r["name"] == baseline)["output_tok_per_s"]
    for row in rows:
        value = row["output_tok_per_s"]
        row["vs_baseline"] = round(value / base, 3) if value and base else None
    result = {"workload": str(workload), "repeats": repeats, "baseline": baseline,
              "host": host, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    return result


def bench_host() -> dict:
    """The machine, date and version the figures come from, and the CPUs other processes kept
    busy when it started (warned: the ratios then carry that noise)."""
    import datetime

    from batchinfer import __version__
    from batchinfer.engine.cpu_binding import allowed_cpus
    from batchinfer.engine.cpu_load import busy_cpus
    from batchinfer.engine.host_cpu import host_record

    busy = busy_cpus(allowed_cpus())
    if busy:
        log.warning("CPU(s) %s are busy with other processes as the bench starts: its figures "
                    "and ratios carry that load; bench again on an idle host",
                    busy_text(busy))
    return {**host_record(), "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "batchinfer_version": __version__,
        "busy_cpus_at_start": {str(cpu): round(share, 2) for cpu, share in busy.items()}}


def _row(config: BenchConfig, runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {"name": config.name, "strategy": config.strategy, "layout": config.layout,
           "runs": len(ok), "errors": [r["error"] for r in runs if "error" in r]}
    for key in (*METRICS, "bubble_ratio", "generation_s"):
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = round(statistics.median(values), 3) if values else None
    row["output_tok_per_s_all"] = [r["output_tok_per_s"] for r in ok]
    row["kv_capacity_tokens"] = ok[-1]["kv_capacity_tokens"] if ok else None
    return row


COLUMNS = (("configuration", "name"), ("strategy", "strategy"), ("layout", "layout"),
           ("output tok/s", "output_tok_per_s"), ("total tok/s", "total_tok_per_s"),
           ("req/s", "requests_per_s"), ("vs baseline", "vs_baseline"),
           ("bubble ratio", "bubble_ratio"), ("KV capacity (tokens)", "kv_capacity_tokens"),
           ("runs", "runs"))


def table_rows(result: dict) -> list[list[str]]:
    out = []
    for row in result["rows"]:
        cells = []
        for _, key in COLUMNS:
            value = row.get(key)
            cells.append("failed" if value is None and key == "output_tok_per_s" and row["errors"]
                         else "–" if value is None else
                         f"{value:,}" if isinstance(value, int) else
                         f"{value:.2f}" if isinstance(value, float) else str(value))
        out.append(cells)
    return out


def markdown(result: dict) -> str:
    host = result.get("host") or {}
    isa = ", ".join(host.get("isa") or []) or "none of the listed ISA flags"
    busy = busy_text(host.get("busy_cpus_at_start") or {})
    lines = [f"# batchinfer bench: {Path(result['workload']).name}", "",
             f"Medians of {result['repeats']} runs per configuration (alternating order); "
             f"baseline: {result['baseline']}.", "",
             f"Host: {host.get('cpu', '?')} ({isa}), "
             f"{host.get('usable_cpus', host.get('cpus', '?'))} usable CPUs, "
             f"{host.get('memory_gib', '?')} GiB; {host.get('date', '?')}; batchinfer "
             f"{host.get('batchinfer_version', '?')}."
             + (f" **CPUs busy with other processes at the start: {busy}.**" if busy else ""),
             "",
             "| " + " | ".join(title for title, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(result)]
    for row in result["rows"]:
        for error in row["errors"]:
            lines += ["", f"{row['name']} failed: {error}"]
    return "\n".join(lines) + "\n"
