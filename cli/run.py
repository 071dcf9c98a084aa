"""`batchinfer run RECIPE --input FILE`: the job."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Iterator, Optional

import typer

from .common import (EXIT_CODES_HELP, external_engine_model, fail, one_file, setup_logging,
                     user_errors, warn_layout_note)

HELP = """Run a batch job over an input file.

Every request in --input goes through the recipe's model; results stream into the run directory (outputs.jsonl, errors.jsonl, report.json/md, metrics.jsonl, plots/).

Example:

    batchinfer run recipes/quickstart.yaml --input examples/quickstart.jsonl

Rerunning the same command resumes: ids already in outputs.jsonl (and lines already in errors.jsonl) are skipped, so every request ends up written exactly once, even after kill -9. Under `srun -n N` each task runs its own shard of the input into part-I-of-N/ of the run directory; `batchinfer report RUN_DIR` merges the parts."""

EPILOG = EXIT_CODES_HELP


def run(
    recipe: Path = typer.Argument(..., help="Recipe YAML, e.g. recipes/quickstart.yaml."),
    input: list[Path] = typer.Option(..., "--input", "-i", metavar="FILE",
                                     help="Prompt file: JSONL (plain, chat or OpenAI batch "
                                          "lines), or a parquet / arrow / csv / json dataset."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory. Default: "
                                          "the recipe's io.output_dir, else runs/<recipe>__<input>."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue a run directory that "
                                "already holds results (default). --no-resume refuses to touch one."),
    force_resume: bool = typer.Option(False, "--force-resume", help="Resume even where the "
                                      "input does not start with the bytes the run started "
                                      "with, or the recipe's model, sampling defaults or "
                                      "prompt / id settings differ (ids alone decide "
                                      "what is skipped)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N input "
                                        "records (after sharding). A later run with a larger N "
                                        "continues where this one stopped."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the recipe and every input line, "
                                 "show what would run; load no model, write nothing."),
    fail_on_errors: bool = typer.Option(False, "--fail-on-errors", help="Exit 1 when any request "
                                        "failed (default: exit 0 and count them)."),
    progress: str = typer.Option("auto", "--progress", help="auto (a bar on a terminal, plain "
                                 "lines otherwise), bar, lines or off."),
    shard: Optional[str] = typer.Option(None, "--shard", help="Run shard I/N of the input "
                                        "(0-based). Default: from SLURM_PROCID / SLURM_NTASKS "
                                        "inside an srun step, else the whole input."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only."),
) -> None:
    input = one_file(input)
    with _stop_on_signals():
        setup_logging(verbose, quiet)
        if progress not in ("auto", "bar", "lines", "off"):
            raise fail(f"--progress {progress!r}: use auto, bar, lines or off")
        from batchinfer.runner.io.inputs import input_file_problem
        from batchinfer.runner.job import JobSpec, default_output_dir, run_job
        from batchinfer.runner.recipe import load_recipe
        from batchinfer.runner.slurm import detect_shard, parse_shard

        _warn_unknown_environment()
        with user_errors(recipe=recipe):
            parsed = load_recipe(recipe)
            problem = input_file_problem(input)
            if problem:
                raise fail(f"--input {input}: {problem}")
            the_shard = parse_shard(shard) if shard else detect_shard()
            out_dir = output or (Path(parsed.io.output_dir) if parsed.io.output_dir
                                 else default_output_dir(str(recipe), input))
            spec = JobSpec(recipe=parsed, input_path=input, output_dir=out_dir,
                           recipe_path=str(recipe), resume=resume, force_resume=force_resume,
                           limit=limit, shard=the_shard, progress=progress)
            if dry_run:
                _dry_run(spec)
                return
            outcome = run_job(spec)
        _summary(outcome)
        code = outcome.exit_code
        if code == 0 and fail_on_errors and outcome.errors:
            code = 1
        raise typer.Exit(code)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Until the job installs its own handlers (and after it restores these): a signal ends the
    command at once with 130 / 143 (128 + the signal's number); nothing has been written yet (or everything has)."""
    from batchinfer.runner.stop_signals import STOP_SIGNALS, exit_code_for, signal_name

    def stop(signum, _frame):
        typer.echo(f"stopped by {signal_name(signum)}", err=True)
        raise SystemExit(exit_code_for(signum))   # not typer.Exit: no `except Exception` stops it

    handled = STOP_SIGNALS
    previous = {sig: signal.getsignal(sig) for sig in handled}
    if threading.current_thread() is threading.main_thread():
        for sig in handled:
            signal.signal(sig, stop)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, old in previous.items():
                signal.signal(sig, old)


def _dry_run(spec) -> None:
    from collections import Counter

    from batchinfer.runner.io.input_records import InputError
    from batchinfer.runner.io.admission import check_recipe_stop_ids
    from batchinfer.runner.io.inputs import InputReader
    from batchinfer.runner.resume_check import (check_other_parts, check_resume,
                                                recipe_change_warning)
    from batchinfer.runner.run_dir import MANIFEST, RECIPE, RunDir, in_use

    from batchinfer.engine.build import model_source, preflight

    embed = spec.recipe.model.task == "embed"
    if embed:               # the embedding model's config, tokenizer and pooling (no weights)
        from batchinfer.engine.embedding.model_source import embedding_source

        vocab = embedding_source(spec.recipe.model).vocab_size
    else:
        external = external_engine_model(spec.recipe)
        if external is None:
            source = model_source(spec.recipe.model)
            preflight(spec.recipe.engine_config(), source.arch, source.max_model_len)
        vocab = external.vocab_size if external is not None else source.arch.vocab_size
    check_recipe_stop_ids(spec.recipe.sampling, vocab)
    warn_layout_note(spec.recipe)
    run_dir, prior = RunDir.open(spec.output_dir, spec.shard, resume=spec.resume, read_only=True)
    try:
        has_results = bool(prior.num_outputs or prior.num_errors)
        old_recipe = run_dir.read_text(RECIPE)
        if has_results and not spec.force_resume:
            check_resume(run_dir.path, run_dir.read_json(MANIFEST) or {}, old_recipe,
                         spec.recipe, spec.input_path)
        changed = recipe_change_warning(run_dir.path, old_recipe, spec.recipe.to_yaml(),
                                        has_results)
        if changed:
            logging.getLogger("batchinfer").warning("%s", changed)
        if spec.shard.count > 1 and not spec.force_resume:
            check_other_parts(run_dir.path, spec.recipe, Path(spec.input_path).resolve())
    finally:
        run_dir.close()
    reader = InputReader(spec.input_path, spec.recipe.io, spec.recipe.sampling, spec.shard,
                         limit=spec.limit, embed=embed)
    to_run, bad = 0, Counter()
    for item in reader.records(prior.done_ids, prior.done_lines):
        if isinstance(item, InputError):
            bad[item.code] += 1
        else:
            to_run += 1
    typer.echo(f"dry run: {spec.input_path} ({reader.format}), run directory {run_dir.path}")
    if in_use(run_dir.path):
        typer.echo("  a run is using this directory now: the counts below are moving, and a "
                   "run started now would be refused until it ends")
    typer.echo(f"  already done: {prior.num_outputs} outputs, {prior.num_errors} errors "
               f"({reader.skipped_done} input records skipped)")
    typer.echo(f"  would run: {to_run} requests")
    if bad:
        typer.echo(f"  would record {sum(bad.values())} input errors: "
                   + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())))
    typer.echo("  (prompt lengths are checked when the model's tokenizer is loaded; "
               "`batchinfer validate` checks them too)")


def _summary(outcome) -> None:
    s = outcome.session
    tp = s.get("throughput") or {}
    typer.echo(f"{outcome.status}: {outcome.outputs} outputs, {outcome.errors} errors in "
               f"{outcome.run_dir}")
    typer.echo(f"  this session: {s.get('requests_completed', 0)} completed, "
               f"{s.get('requests_failed', 0)} failed in {s.get('generation_s', 0):.1f}s; "
               f"{_rate(tp.get('requests_per_s'))} req/s, "
               + (f"{_rate(tp.get('output_tokens_per_s'))} output tok/s, "
                  f"{_rate(tp.get('total_tokens_per_s'))} total tok/s"
                  if "output_tokens_per_s" in tp else      # an embedding job's: prompts only
                  f"{_rate(tp.get('input_tokens_per_s'))} prompt tok/s"))
    typer.echo(f"  report: {outcome.run_dir / 'report.md'}")
    if outcome.message:
        typer.echo(f"  {outcome.message}")


def _rate(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def _warn_unknown_environment() -> None:
    """A mistyped BATCHINFER_* variable would silently do nothing: say so (engine/envs.py)."""
    import logging

    from batchinfer.engine.envs import unknown_in_environment

    for name in unknown_in_environment():
        logging.getLogger("batchinfer").warning("environment variable %s is not one batchinfer "
                                                "reads (docs/engine.md lists them)", name)
