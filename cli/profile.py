"""`batchinfer profile RECIPE --input FILE`: measure (or take a preset), simulate, rank, pick."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .common import fail, one_file, setup_logging, user_errors

HELP = """Pick the strategy and parallel layout for a job by simulating it.

Samples the input lengths of --input and the output lengths from the recipe's predictor (or --history), then simulates every applicable strategy (baseline SB / HB, TD-Pipe, gLLM, the recipe's own) on every (tp, pp, dp) layout with the engine's real schedulers, and prints them ranked by predicted output tok/s with KV capacity and pipeline bubble ratio. Writes profile_table.json (measured), ranking.json and best_recipe.yaml to --out.

--hardware measured (default) profiles this machine for the recipe's model first (a few minutes, with a progress bar on a terminal, else a timestamped line every 10 s; it warns when other processes keep CPUs busy; reuse the table with --table). A preset (a10, l4, l20, a100-pcie, a100-sxm, h100, h20, h200) plans for GPUs that are not here, with a roofline cost model of their specs; --model then names a preset model (the papers' llama2-13b, codellama-34b, llama3.1-70b, qwen2.5-14b, qwen2.5-32b, qwen2.5-72b, and qwen3-30b-a3b) if the recipe's is not the one to plan for.

Examples:

    batchinfer profile recipes/quickstart.yaml --input examples/quickstart.jsonl
    batchinfer profile recipes/quickstart.yaml --input prompts.jsonl --hardware l20 --gpus 4 --model llama2-13b"""

EPILOG = ("Every number printed is simulated. Exit codes: 0 done, 2 bad recipe, input, table or "
          "arguments, or no candidate could run (ranking.json says why for each).")


def profile(
    recipe: Path = typer.Argument(..., help="Recipe YAML."),
    input: list[Path] = typer.Option(..., "--input", "-i", metavar="FILE",
                                     help="The job's prompt file."),
    hardware: str = typer.Option("measured", "--hardware", help="measured (this machine) or a "
                                 "preset: a10, l4, l20, a100-pcie, a100-sxm, h100, h20, h200."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="Ranks a layout uses. "
                                       "Default: 4 for a preset; the cores on a CPU host; the "
                                       "GPUs a measured GPU table was profiled with."),
    model: Optional[str] = typer.Option(None, "--model", help="A preset model to plan for "
                                        "(with a preset --hardware)."),
    table: Optional[Path] = typer.Option(None, "--table", help="A profile table saved by an "
                                         "earlier run (profile_table.json), or one shipped "
                                         "(h100-llama-3.1-8b, h100-smollm2-135m: measured on "
                                         "one H100): no measuring."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where the table, ranking and "
                                       "winning recipe go. Default: profile-<recipe>/."),
    requests: int = typer.Option(2000, "--requests", min=1, help="Simulate the first N usable "
                                 "requests of --input."),
    history: Optional[list[Path]] = typer.Option(None, "--history", help="Run directory or "
                                                 "history.jsonl whose output lengths to sample "
                                                 "(repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranking as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only."),
) -> None:
    json_fields = ({"recipe": str(recipe), "input": ", ".join(map(str, input))} if as_json
                   else None)       # one --input (one_file refuses more): its path
    input = one_file(input, json_fields=json_fields)
    setup_logging(quiet=True if as_json else quiet)
    from batchinfer.runner.io.inputs import input_file_problem
    from batchinfer.runner.recipe import load_recipe
    from batchinfer.predictors import PredictorError
    from batchinfer.sim.planner import plan

    out_dir = out or Path(f"profile-{recipe.stem}")
    with user_errors(json_fields, recipe=recipe):
        parsed = load_recipe(recipe)
        problem = input_file_problem(input)
        if problem:
            raise fail(f"--input {input}: {problem}", json_fields=json_fields)
        if table is not None and hardware != "measured":
            raise fail("--table is a measured profile; it goes with --hardware measured",
                       json_fields=json_fields)
        problem = _out_problem(out_dir)   # before minutes of measuring, whose table goes there
        if problem:
            raise fail(f"--out {out_dir}: {problem}", json_fields=json_fields)
        if hardware != "measured":      # a bad preset is refused before anything is measured
            from batchinfer.sim.hardware import preset

            try:
                preset(hardware)
            except ValueError as exc:
                raise fail(f"--hardware: {exc}", json_fields=json_fields) from None
        try:
            with _progress(as_json or quiet) as update:
                result = plan(parsed, input, out_dir, hardware, gpus, table, model, requests,
                              history, progress=update)
        except (ValueError, FileNotFoundError, PredictorError) as exc:
            raise fail(str(exc), json_fields=json_fields) from None
    if result.best_recipe is None:
        raise fail(_none_ran(result), json_fields={**json_fields, "ranking": str(
            result.out_dir / "ranking.json")} if json_fields is not None else None)
    if as_json:
        import json

        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        _render(result)


def _out_problem(out_dir: Path) -> Optional[str]:
    """Why the table, ranking and winning recipe could not be written under `out_dir` (a file
    there or on the way to it, a directory that is not writable); None when they can."""
    if out_dir.exists() and not out_dir.is_dir():
        return "a file is there; give a directory for the table, ranking and winning recipe"
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so the directory cannot be made"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


SKIPPED_LISTED = 12     # reasons in the error when no candidate ran; ranking.json has them all


def _none_ran(result) -> str:
    """Exit 2's message when every candidate was skipped: the job cannot run in any layout on
    this hardware, each layout's reason (ranking.json keeps them all)."""
    skipped = [c for c in result.ranked if c.result is None]
    lines = [f"  {c.label} tp={c.tp} pp={c.pp} dp={c.dp}: {c.skipped}"
             for c in skipped[:SKIPPED_LISTED]]
    if len(skipped) > SKIPPED_LISTED:
        lines.append(f"  ... and {len(skipped) - SKIPPED_LISTED} more")
    return ("no candidate could run: the job cannot run in any layout of "
            f"{_where(result.setup.description)}; each was skipped:\n" + "\n".join(lines)
            + f"\n(every candidate and reason: {result.out_dir / 'ranking.json'})")


def _where(desc: dict) -> str:
    """The cost model in words: the measured table and its machine, or the preset."""
    if desc.get("hardware") != "measured":
        return f"{desc['gpus']} x {desc['hardware']} ({desc['source']}), model {desc['model']}"
    host = [desc.get("device"), f"{desc.get('cores')} cores", desc.get("card"),
            desc.get("cpu_model")]
    if desc.get("measured_on"):
        host.append(f"measured {desc['measured_on']}")
    return (f"the measured profile {desc.get('table')} "
            f"({', '.join(str(part) for part in host if part)})")


class _progress:
    """The steps of the profile, then the candidates simulated: a rich bar on a terminal, else
    (a log, cron, Slurm) a timestamped line every `interval_s` as `run` prints
    (runner/progress.py decides the same way); nothing when quiet."""

    def __init__(self, silent: bool, stream=None, interval_s: float = 10.0):
        self.silent = silent
        self.stream = stream
        self.interval_s = interval_s
        self.bar = None
        self.task = None
        self.lines = False
        self.start = self.last_line = None

    def __enter__(self):
        if self.silent:
            return self.update
        stream = self.stream or sys.stderr
        if getattr(stream, "isatty", lambda: False)():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            from batchinfer.runner.progress import stderr_console

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), console=stderr_console(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("starting", total=None)
        else:
            self.stream, self.lines = stream, True
            self.start = time.monotonic()
        return self.update

    def update(self, message: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=message, completed=done, total=total)
        elif self.lines:
            now = time.monotonic()
            if self.last_line is not None and now - self.last_line < self.interval_s:
                return
            self.last_line = now
            from batchinfer.runner.progress import hms, now_stamp

            print(f"{now_stamp()} batchinfer profile: {message} (step {done} of {total}), "
                  f"elapsed {hms(now - self.start)}", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _render(result) -> None:
    from rich.console import Console
    from rich.table import Table

    # piped to a file or a log, rich would cut the table's numbers to 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=200)
    setup, workload = result.setup, result.workload.summary()
    console.print(f"[bold]Simulated[/bold] on {_where(setup.description)}")
    console.print(f"workload: {workload['requests']} requests (mean prompt "
                  f"{workload['mean_prompt_tokens']} tokens, mean output "
                  f"{workload['mean_output_tokens']} from {workload['output_lengths_from']})"
                  + (f"; left out: {workload['skipped']}" if workload["skipped"] else ""))
    grid = Table(title="strategies x layouts, best first (simulated)")
    for col in ("#", "strategy", "tp", "pp", "dp", "out tok/s", "total tok/s", "KV/replica",
                "bubble", "preempt"):
        grid.add_column(col, justify="left" if col == "strategy" else "right",
                        no_wrap=col == "strategy")
    rank = 0
    for cand in result.ranked:
        r = cand.result
        if r is None:
            continue
        rank += 1
        bubble = f"{r.bubble_ratio:.0%}" if r.bubble_ratio is not None else "-"
        grid.add_row(str(rank), cand.label, str(cand.tp), str(cand.pp), str(cand.dp),
                     f"{r.output_tok_per_s:,.1f}", f"{r.total_tok_per_s:,.1f}",
                     f"{r.kv_capacity_tokens // max(cand.dp, 1):,}", bubble,
                     str(r.preemptions))
    console.print(grid)
    skipped = [c for c in result.ranked if c.result is None]
    for cand in skipped:
        console.print(f"  skipped {cand.label} tp={cand.tp} pp={cand.pp} dp={cand.dp}: "
                      f"{cand.skipped}")
    console.print(f"winning recipe: {result.out_dir / 'best_recipe.yaml'}")
    console.print(f"ranking: {result.out_dir / 'ranking.json'}")
