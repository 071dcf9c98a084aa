"""`batchinfer validate RECIPE --input FILE`: check everything a run would, without a model."""
from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import typer

from .common import (collect_warnings, external_engine_model, fail, one_file, setup_logging,
                     user_errors, warn_layout_note)

HELP = """Check a recipe and every input line, without loading a model.

Checks shapes, types, sampling ranges, duplicate ids, and (with the model's tokenizer, which is cheap to load) prompt lengths against max_model_len. Lists each bad line with its number and what is wrong.

Example:

    batchinfer validate recipes/quickstart.yaml --input examples/quickstart.jsonl"""

EPILOG = ("Exit codes: 0 the recipe and every line are fine, 1 some lines would fail (a run "
          "would record them in errors.jsonl and go on), 2 bad recipe, input file or arguments.")


def validate(
    recipe: Path = typer.Argument(..., help="Recipe YAML."),
    input: list[Path] = typer.Option(..., "--input", "-i", metavar="FILE",
                                     help="Prompt file to check."),
    tokenize: bool = typer.Option(True, "--tokenize/--no-tokenize", help="Load the tokenizer "
                                  "to check prompt lengths (default)."),
    show: int = typer.Option(20, "--show", min=0, help="How many bad lines to print."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only."),
) -> None:
    json_fields = ({"recipe": str(recipe), "input": ", ".join(map(str, input)), "warnings": []}
                   if as_json else None)       # one --input (one_file refuses more): its path
    input = one_file(input, json_fields=json_fields)
    setup_logging(quiet=True if as_json else quiet)
    if as_json:
        collect_warnings(json_fields["warnings"])
    from batchinfer.runner.io.inputs import InputReader, input_file_problem
    from batchinfer.runner.recipe import load_recipe

    with user_errors(json_fields, recipe=recipe):
        parsed = load_recipe(recipe)
        warn_layout_note(parsed)
        problem = input_file_problem(input)
        if problem:
            raise fail(f"--input {input}: {problem}", json_fields=json_fields)
        reader = InputReader(input, parsed.io, parsed.sampling,
                             embed=parsed.model.task == "embed")
        tokenizer, max_len, vocab = (_tokenizer(parsed) if tokenize
                                     else _checked_without_tokenizer(parsed))
        if vocab:
            from batchinfer.runner.io.admission import check_recipe_stop_ids

            check_recipe_stop_ids(parsed.sampling, vocab, tokenizer)

    bad: list[dict] = []
    codes: Counter = Counter()
    with user_errors(json_fields):          # a file that breaks part way (a malformed CSV row)
        good = _check_items(reader, tokenizer, max_len, vocab, parsed, show, bad, codes)
    _report(json_fields, recipe, input, reader, good, bad, codes, max_len)


def _check_items(reader, tokenizer, max_len, vocab, parsed, show: int, bad: list,
                 codes: Counter) -> int:
    """Every record checked as a run would: the problems (the first `show`) into `bad`, their
    codes counted; -> how many are valid."""
    from batchinfer.engine.errors import RequestError
    from batchinfer.runner.io.input_records import InputError

    good = 0
    for item in reader:
        if isinstance(item, InputError):
            problem = {"line": item.line, "id": item.request_id, "code": item.code,
                       "message": item.message}
        elif tokenizer is not None and parsed.model.task == "embed":   # (the model's source)
            from batchinfer.runner.embed_validate import check_embed_item

            try:
                check_embed_item(item, tokenizer, parsed.io.chat_template)
                good += 1
                continue
            except RequestError as exc:
                problem = {"line": item.line, "id": item.request_id, "code": exc.code,
                           "message": exc.message}
        elif tokenizer is not None:
            from batchinfer.engine.admission import check_prompt_ids
            from batchinfer.runner.io.admission import (check_stop_token_ids, prompt_token_ids,
                                                        request_lora)

            try:
                request_lora(item, list(parsed.model.lora_modules))     # an adapter it names
                check_prompt_ids(prompt_token_ids(item, tokenizer, parsed.io.chat_template),
                                 max_len or sys.maxsize, vocab)   # None: a config without one
                check_stop_token_ids(item, vocab, tokenizer)
                good += 1
                continue
            except RequestError as exc:
                problem = {"line": item.line, "id": item.request_id, "code": exc.code,
                           "message": exc.message}
        else:
            good += 1
            continue
        codes[problem["code"]] += 1
        if len(bad) < show:
            bad.append(problem)
    return good


def _report(json_fields: Optional[dict], recipe: Path, input: Path, reader, good: int,
            bad: list, codes: Counter, max_len: Optional[int]) -> None:
    total_bad = sum(codes.values())
    code = 1 if total_bad else 0
    if json_fields is not None:
        typer.echo(json.dumps({**json_fields, "input": str(input), "format": reader.format,
                               "valid": good, "invalid": total_bad, "errors_by_code": dict(codes),
                               "errors": bad, "exit_code": code}, indent=2))
    else:
        typer.echo(f"recipe {recipe}: ok")
        typer.echo(f"input {input} ({reader.format}): {good} valid, {total_bad} invalid"
                   + (f" (prompt lengths checked against max_model_len {max_len})" if max_len else
                      " (prompt lengths not checked)"))
        for problem in bad:
            typer.echo(f"  line {problem['line']}: [{problem['code']}] {problem['message']}")
        if total_bad > len(bad):
            typer.echo(f"  ... and {total_bad - len(bad)} more")
        if codes:
            typer.echo("  by code: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    raise typer.Exit(code)


def _checked_without_tokenizer(recipe) -> tuple[None, None, int]:
    """--no-tokenize: the refusals that need no weights (preflight: layout, device, the
    strategy's own), from the model's config where it is at hand; no tokenizer loads, no GGUF is
    converted, and a model that is not here (validating inputs on another machine) is no error."""
    from batchinfer.engine.build import _max_model_len, preflight
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.model.sources import model_dir_at_hand

    if recipe.model.task == "embed":
        from batchinfer.runner.embed_validate import embed_model_for_validate

        return embed_model_for_validate(recipe, tokenize=False)
    external = external_engine_model(recipe, tokenize=False)
    if external is not None:
        return None, None, external.vocab_size
    model_dir = model_dir_at_hand(recipe.model.path)
    if model_dir is None:
        logging.getLogger("batchinfer").warning(
            "--no-tokenize: the model's config is not at hand (not here, or a GGUF not converted "
            "yet): the parallel layout and the device were not checked against it")
        return None, None, 0
    arch = load_arch(model_dir, recipe.model.hf_overrides or None)
    preflight(recipe.engine_config(), arch, _max_model_len(recipe.model.max_model_len, arch))
    return None, None, arch.vocab_size


def _tokenizer(recipe) -> tuple[Optional[object], Optional[int], int]:
    """The model's tokenizer, max_model_len and vocabulary size as the engine reads them
    (engine.build.model_source), after its refusals that need no weights (preflight)."""
    from batchinfer.engine.build import model_source, preflight

    if recipe.model.task == "embed":        # the embedding model's files, no weights
        from batchinfer.runner.embed_validate import embed_model_for_validate

        return embed_model_for_validate(recipe)
    external = external_engine_model(recipe)
    if external is not None:
        return external
    source = model_source(recipe.model)
    preflight(recipe.engine_config(), source.arch, source.max_model_len)
    return source.tokenizer, source.max_model_len, source.arch.vocab_size
