"""`batchinfer report RUN_DIR`: re-render a run's report; merge the parts of a Slurm run."""
from __future__ import annotations

from pathlib import Path

import typer

from .common import fail, setup_logging, user_errors

HELP = """Re-render (and print) a run directory's report; merge Slurm parts.

Rewrites report.json, report.md and the plots from the run directory's files (counts are taken again from outputs.jsonl and errors.jsonl). For a run made under `srun -n N`, merges the part-I-of-N/ reports into one report at the top of the run directory.

Example:

    batchinfer report runs/quickstart__quickstart"""

EPILOG = "Exit codes: 0 report written, 2 not a run directory."


def report(
    run_dir: Path = typer.Argument(..., help="Run directory (the one `batchinfer run` wrote)."),
    print_report: bool = typer.Option(True, "--print/--no-print", help="Print report.md."),
) -> None:
    setup_logging(quiet=True)
    from batchinfer.runner.report.report_files import rerender

    if not run_dir.is_dir():
        raise fail(f"{run_dir}: " + ("not a directory; give the run directory"
                                     if run_dir.exists() else "no such directory"))
    with user_errors():
        markdown = rerender(run_dir)
    if markdown is None:
        from batchinfer.runner.run_dir import MANIFEST

        if (run_dir / MANIFEST).is_file():
            raise fail(f"{run_dir}: a run started here but has written no report.json (a run "
                       "that failed or was stopped while setting up writes none; a running one "
                       "writes it within seconds); rerun its command to resume it")
        raise fail(f"{run_dir}: no report.json here or in part-*/ (is it a batchinfer run "
                   "directory?)")
    if print_report:
        typer.echo(markdown)
