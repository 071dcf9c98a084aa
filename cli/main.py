"""The `batchinfer` command: run, validate, report, profile, bench, predictor."""
from __future__ import annotations

from typing import Optional

import typer

from batchinfer import __version__

from . import bench as bench_cmd
from . import predictor as predictor_cmd
from . import profile as profile_cmd
from . import report as report_cmd
from . import run as run_cmd
from . import validate as validate_cmd

app = typer.Typer(
    name="batchinfer",
    help="Offline batch LLM jobs: a YAML recipe and a prompt file in, a run directory with every "
         "output, every error and a throughput report out.\n\n"
         "Quickstart:  batchinfer run recipes/quickstart.yaml --input examples/quickstart.jsonl",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchinfer {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(version: Optional[bool] = typer.Option(None, "--version", callback=_version,
                                                is_eager=True, help="Print the version and exit.")):
    """Offline batch LLM job runner."""


app.command("run", help=run_cmd.HELP, epilog=run_cmd.EPILOG)(run_cmd.run)
app.command("validate", help=validate_cmd.HELP, epilog=validate_cmd.EPILOG)(validate_cmd.validate)
app.command("report", help=report_cmd.HELP, epilog=report_cmd.EPILOG)(report_cmd.report)
app.command("profile", help=profile_cmd.HELP, epilog=profile_cmd.EPILOG)(profile_cmd.profile)
app.command("bench", help=bench_cmd.HELP, epilog=bench_cmd.EPILOG)(bench_cmd.bench)
app.add_typer(predictor_cmd.app, name="predictor")


if __name__ == "__main__":
    app()
