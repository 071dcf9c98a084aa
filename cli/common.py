"""What every command shares: logging setup and turning user errors into exit code 2."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Iterator, NamedTuple, Optional

import typer

EXIT_CODES_HELP = ("Exit codes: 0 done (per-request errors are counted in the summary; with "
                   "--fail-on-errors they make it 1), 2 bad recipe, input file or arguments, 3 the "
                   "run itself failed (rerun to resume), 130 / 143 interrupted by SIGINT / SIGTERM "
                   "(138 / 129 by SIGUSR1 / SIGHUP; rerun to resume).")


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        from batchinfer.runner.progress import stderr_console

        handler: logging.Handler = RichHandler(console=stderr_console(), show_path=False,
                                               rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("batchinfer").setLevel(level)
    for noisy in ("transformers", "datasets", "huggingface_hub", "matplotlib", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


class _Collected(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def collect_warnings(into: list) -> None:
    """--json: the command's warnings (e.g. a layout note) also go into `into`, a list its JSON
    object holds; they still reach stderr. Until the next setup_logging."""
    logging.getLogger().addHandler(_Collected(into))


def warn_layout_note(recipe) -> None:
    """The strategy's warnings (StrategyParams.notes: a layout where its mechanism has nothing
    to do, knobs of a part switched off), as validate and run --dry-run give them."""
    for note in recipe.strategy.notes(recipe.parallel):
        logging.getLogger("batchinfer").warning("%s", note)


def one_file(values: Optional[list], option: str = "--input",
             json_fields: Optional[dict] = None):
    """A file option declared repeatable (a list) so that giving it twice is an error instead of
    click keeping the last one silently; -> the one file, or None. json_fields: as `fail`'s."""
    if not values:
        return None
    if len(values) > 1:
        raise fail(f"{option} given {len(values)} times ({', '.join(map(str, values))}): give "
                   "one file (join them into one, or run each into its own run directory)",
                   json_fields=json_fields)
    return values[0]


def fail(message: str, code: int = 2, json_fields: Optional[dict] = None) -> "typer.Exit":
    """The error on stderr; with `json_fields` (a command's --json) also as a JSON object on
    stdout, those fields plus "error" and "exit_code", so a script reading stdout gets JSON."""
    typer.echo(f"error: {message}", err=True)
    if json_fields is not None:
        typer.echo(json.dumps({**json_fields, "error": message, "exit_code": code}, indent=2))
    return typer.Exit(code)


@contextlib.contextmanager
def user_errors(json_fields: Optional[dict] = None, recipe: Optional[object] = None
                ) -> Iterator[None]:
    """ConfigError, ModelLoadError, RecipeError, bad input file -> message and exit 2 (`fail`);
    with `recipe` (its path) an engine error naming a recipe key also names its file and line."""
    from batchinfer.engine.errors import ConfigError, ModelLoadError
    from batchinfer.runner.io.inputs import InputFileError
    from batchinfer.runner.recipe_errors import RecipeError, located

    try:
        yield
    except (ConfigError, ModelLoadError, InputFileError) as exc:
        message = str(exc)
        if not isinstance(exc, (RecipeError, InputFileError)) and recipe:
            message = located(message, str(recipe))
        raise fail(message, json_fields=json_fields) from None


class ExternalModel(NamedTuple):
    """What the checks read of a model another engine runs (external_engine_model)."""
    tokenizer: Optional[object]
    max_model_len: Optional[int]
    vocab_size: int


def external_engine_model(recipe, tokenize: bool = True) -> Optional[ExternalModel]:
    """A strategy that hands the job to another engine (strategy vllm) over an architecture our
    engine does not run (the route its error names): that strategy's own checks, then (the
    tokenizer, or None without `tokenize`, max_model_len, vocabulary size) from the model's
    tokenizer and config.json, in place of the engine's checks, which need an architecture it
    reads. None otherwise (the engine's checks apply)."""
    if not getattr(recipe.strategy, "external_engine", False):
        return None
    from batchinfer.engine.model.arch import foreign_model
    from batchinfer.engine.model.sources import model_dir_at_hand, resolve_model_dir
    from batchinfer.engine.tokenizer import load_tokenizer

    if tokenize:
        model_dir, model_id = resolve_model_dir(recipe.model.path)
    else:
        model_dir, model_id = model_dir_at_hand(recipe.model.path), None
        if model_dir is None:
            return None
    foreign = foreign_model(model_dir, recipe.model.hf_overrides or None)
    if foreign is None:
        return None
    recipe.strategy.check_config(recipe.engine_config(), None)
    tokenizer = load_tokenizer(recipe.model, model_dir, model_id) if tokenize else None
    vocab, context = foreign
    return ExternalModel(tokenizer, recipe.model.max_model_len or context,
                         vocab or (tokenizer.vocab_size if tokenizer is not None else 0))
