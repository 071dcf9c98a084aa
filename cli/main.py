"""The `batchinfer` command: run, validate, report, profile, bench, predictor."""
from __future__ import annotations

import json
import sys
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


def cli(prog_name: Optional[str] = None) -> None:
    """The console script: `app`, except that a command given --json answers an arguments error
    (caught by click before the command runs: a missing --input, an unknown option) with one JSON
    object on stdout too, as its own errors do."""
    if "--json" not in sys.argv[1:]:
        app(prog_name=prog_name)
        return
    try:
        code = app(prog_name=prog_name, standalone_mode=False)
    except _arguments_error() as exc:
        exc.show()
        recipe, input_path = _named_in(sys.argv[1:])
        typer.echo(json.dumps({"recipe": recipe, "input": input_path,
                               "error": exc.format_message(), "exit_code": exc.exit_code},
                              indent=2))
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code or 0)


def _named_in(args: list[str]) -> tuple[Optional[str], Optional[str]]:
    """The recipe (the first .yaml / .yml argument after the command) and the --input / -i
    value an arguments error left unread, as the command's own JSON would name them."""
    recipe = next((a for a in args[1:] if not a.startswith("-")
                   and a.lower().endswith((".yaml", ".yml"))), None)
    input_path = None
    for i, arg in enumerate(args):
        if arg.startswith("--input="):
            input_path = arg.split("=", 1)[1]
        elif arg in ("--input", "-i") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            input_path = args[i + 1]
    return recipe, input_path


def _arguments_error() -> type:
    """click's ClickException: typer's own copy of click (0.29 on) or click's."""
    vendored = getattr(typer, "TyperException", None)
    if vendored is not None:
        return vendored
    import click

    return click.ClickException


if __name__ == "__main__":
    cli()
