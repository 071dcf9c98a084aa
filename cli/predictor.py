"""`batchinfer predictor train|eval`: the output-length predictor, trained on run history."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from .common import fail, setup_logging, user_errors

HELP = """Train and evaluate the output-length predictor (TD-Pipe's BERT classifier).

Every `batchinfer run` appends one line per finished request to history.jsonl in its run directory; that history is the training data.

Example:

    batchinfer predictor train --history runs/predictor_history__predictor_prompts --out runs/length_predictor
    batchinfer predictor eval runs/length_predictor --history runs/predictor_history__predictor_prompts

Then use it in a recipe:  predictor: {name: bert, path: runs/length_predictor}"""

TRAIN_HELP = """Train a BERT length classifier on run history (60/20/20 split).

Classes are ranges between percentiles of the training output lengths ([P0,P25) ... [P99,inf) by default); the predicted length is the class's training mean. Writes DIR/predictor.json and DIR/README.md (the model card: data, classes, test metrics), weights.safetensors and split.json.

Example:

    batchinfer predictor train --history runs/predictor_history__predictor_prompts --out runs/length_predictor"""

EVAL_HELP = """Evaluate a trained predictor on history it did not train on.

Reports per-request class accuracy (and the majority-class baseline) and TD-Pipe Fig. 14's accumulated error: the mean over groups of N requests of |sum predicted - sum actual| / sum actual, for N = 1, 8, 32, 128, 256. By default records of the predictor's own train and validation splits are left out.

Example:

    batchinfer predictor eval runs/length_predictor --history runs/predictor_history__predictor_prompts"""

app = typer.Typer(name="predictor", help=HELP, no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise fail(f"{what} {text!r}: give comma-separated numbers, e.g. 0,25,50,75,99") from None


def _device(device: Optional[str]) -> Optional[str]:
    """--device: cpu, or cuda (cuda:N) where torch sees a CUDA device."""
    if device is None:
        return None
    import torch

    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise fail(f"--device {device!r}: use cpu or cuda")
    if device != "cpu" and not torch.cuda.is_available():
        raise fail(f"--device {device}: torch sees no CUDA device here; use cpu")
    return device


def _read(history: list[Path], model: Optional[str]):
    from batchinfer.predictors.history import read_history

    for path in history:
        _shipped_copy_check(path, "--history ")
    try:
        data = read_history(history, model=model, need_text=True)
    except FileNotFoundError as exc:
        raise fail(f"--history {exc}") from None
    models = data.models()
    if model is None and len(models) > 1:
        listed = ", ".join(f"{m} ({n})" for m, n in models.most_common())
        raise fail(f"the history holds outputs of {len(models)} models ({listed}); a predictor is "
                   "per model: pick one with --model")
    return data


def _shipped_copy_check(path: Path, option: str = "") -> None:
    """A docs command's predictors/shipped/... or examples/... path, run where it is not (an
    installed wheel): the error names batchinfer's own copy."""
    from batchinfer.runner.shipped_files import missing_dir_problem

    problem = missing_dir_problem(path)
    if problem:
        raise fail(option + problem)


@app.command("train", help=TRAIN_HELP)
def train(
    history: list[Path] = typer.Option(..., "--history", help="Run directory (or history.jsonl); "
                                       "repeat the option for several."),
    out: Path = typer.Option(..., "--out", "-o", help="Predictor directory to write."),
    model: Optional[str] = typer.Option(None, "--model", help="Only history of this model id "
                                        "(needed when the history mixes models)."),
    percentiles: str = typer.Option("0,25,50,75,99", help="Class edges as percentiles of the "
                                    "training output lengths."),
    epochs: int = typer.Option(40, min=1, help="Training epochs (the best on validation is kept)."),
    train_layers: int = typer.Option(0, min=0, max=6, help="Top encoder layers to fine-tune with "
                                     "the head (0: head only, fast)."),
    lr: float = typer.Option(1e-3, help="Head learning rate."),
    batch_size: int = typer.Option(64, min=1, help="Batch size for training and inference."),
    pooling: str = typer.Option("cls", help="cls (the paper's [CLS] state) or mean."),
    max_length: int = typer.Option(256, min=8, max=512, help="Prompt tokens the encoder reads "
                                   "(up to BERT's 512; 256 measured as accurate at 2/3 the cost)."),
    truncation: str = typer.Option("head", help="What a longer prompt keeps: head (its start) or "
                                   "head_tail (its start and end, half each)."),
    seed: int = typer.Option(0, help="Seed for the split, the head's init and the shuffles."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    as_json: bool = typer.Option(False, "--json", help="Print the model card as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    setup_logging(verbose)
    if pooling not in ("cls", "mean"):
        raise fail(f"--pooling {pooling!r}: use cls or mean")
    if truncation not in ("head", "head_tail"):
        raise fail(f"--truncation {truncation!r}: use head or head_tail")
    _check_out(out)
    device = _device(device)
    from batchinfer.predictors.train import TrainConfig, train_predictor

    cfg = TrainConfig(percentiles=_floats(percentiles, "--percentiles"), seed=seed, epochs=epochs,
                      batch_size=batch_size, lr=lr, train_layers=train_layers, pooling=pooling,
                      max_length=max_length, truncation=truncation, device=device)
    with user_errors():
        data = _read(history, model)
        _check_enough(data)
        card = train_predictor(data.records, out, cfg, sources=[str(h) for h in history],
                               skipped=dict(data.skipped)).card
    if as_json:
        typer.echo(json.dumps(card, indent=2))
        return
    _print_card(card, out)


def _check_out(out: Path) -> None:
    """--out must be a directory this can write, checked before hours of training (and made
    only when the predictor is saved): a file there, or on the way to it, or a directory that
    is not writable is refused; files already there are replaced, said."""
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out}: a file is there; give a directory for the predictor")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise fail(f"--out {out}: {existing} is a file, so the directory cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise fail(f"--out {out}: {existing} is not writable")
    if out.is_dir() and any(out.iterdir()):
        typer.echo(f"note: {out} is not empty; the predictor's files there are replaced", err=True)


@app.command("eval", help=EVAL_HELP)
def evaluate(
    predictor_dir: Path = typer.Argument(..., help="A directory made by `predictor train`."),
    history: list[Path] = typer.Option(..., "--history", help="Run directory (or history.jsonl); "
                                       "repeat the option for several."),
    all_records: bool = typer.Option(False, "--all", help="Also records the predictor trained "
                                     "or validated on."),
    groups: str = typer.Option("1,8,32,128,256", help="Group sizes N of the accumulated error."),
    rounds: int = typer.Option(20, min=1, help="Shuffles averaged in the accumulated error."),
    seed: int = typer.Option(0, help="Seed of those shuffles."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    encoder_int8: bool = typer.Option(False, "--encoder-int8", help="Run the encoder's linears "
                                      "in int8 as a job on an AVX512-VNNI CPU does (recipe "
                                      "predictor.encoder_int8: auto); default fp32, as trained."),
    encoder_bf16_attention: bool = typer.Option(
        False, "--encoder-bf16-attention", help="Run the encoder's attention in bf16 dot products "
        "as a job on an AVX512-BF16 CPU does (recipe predictor.encoder_bf16_attention: auto); "
        "default fp32, as trained."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    setup_logging(verbose)
    from batchinfer.predictors.bert import BertLengthPredictor
    from batchinfer.predictors.train import evaluate as run_eval
    from batchinfer.predictors.train import (evaluate_by_source, held_out, load_split,
                                             source_name, training_sources)

    sizes = _group_sizes(groups)
    device = _device(device)
    _shipped_copy_check(predictor_dir)
    with user_errors():
        predictor = BertLengthPredictor.load(predictor_dir, device=device,
                                             encoder_int8=encoder_int8,
                                             encoder_bf16_attention=encoder_bf16_attention)
        models = predictor.card["data"].get("models") or []
        data = _read(history, models[0] if len(models) == 1 else None)
        if not data.records:
            raise fail(_no_records(history, data, models))
        split = load_split(predictor_dir)
        if split is None and not all_records:
            typer.echo(f"note: {predictor_dir} has no readable split.json, so the records it "
                       "trained on are unknown: every record is evaluated", err=True)
        held_out_only = not all_records and split is not None
        split = split or {}
        records = held_out(data.records, split) if held_out_only else data.records
        if not records:
            raise fail(f"no held-out records in {', '.join(map(str, history))} (every one was used "
                       "for training or validation); pass other history or --all"
                       if held_out_only else
                       f"no records in {', '.join(map(str, history))}")
        metrics = run_eval(predictor, records, sizes, rounds, seed)
        trained_on = training_sources(predictor.card, data.records, split)
        sources = {source_name(r) for r in records}
        if len(sources) > 1 or (trained_on is not None and not sources <= trained_on):
            metrics["by_source"] = evaluate_by_source(predictor, records, trained_on, sizes,
                                                      rounds, seed)
    metrics["held_out_only"] = held_out_only
    if as_json:
        typer.echo(json.dumps(metrics, indent=2))
        return
    _print_metrics(metrics, f"{predictor_dir} on {metrics['records']} "
                   f"{'held-out records' if held_out_only else 'records'}")
    by_source = metrics.get("by_source")
    if by_source:
        for label in ("in_distribution", "out_of_distribution"):
            if label in by_source:
                m = by_source[label]
                _print_metrics(m, f"{label.replace('_', ' ')}: {m['records']} records")
        groups = sum(label in by_source for label in ("in_distribution", "out_of_distribution"))
        sources = by_source["sources"]
        for name, m in (sources.items() if len(sources) > groups else ()):
            where = {True: "in distribution", False: "out of distribution"}.get(
                m.get("in_distribution"), "distribution unknown")
            _print_metrics(m, f"source {name} ({where}): {m['records']} records")


def _check_enough(data) -> None:
    """Too few records to train on because lines were skipped: say which and why (running
    more requests does not help a history kept as hashes, or another model's)."""
    from batchinfer.predictors.train import MIN_RECORDS

    if len(data.records) >= MIN_RECORDS or not data.num_skipped:
        return      # train_predictor's own message: run more requests
    why = _skipped_text(data)
    hint = (" (runs with predictor.history_prompts: hash keep no prompt text to train on)"
            if any(k.startswith("no prompt text") for k in data.skipped) else "")
    raise fail(f"too little history to train on: {len(data.records)} usable records, at least "
               f"{MIN_RECORDS} are needed; {data.num_skipped} lines were skipped ({why}){hint}")


def _no_records(history: list[Path], data, models: list) -> str:
    """Why eval has nothing to evaluate: every line skipped, and for what (another model's
    replies are not this predictor's to be judged on)."""
    where = ", ".join(map(str, history))
    if not data.num_skipped:
        return f"no records in {where}"
    why = _skipped_text(data)
    text = f"no usable records in {where}: all {data.num_skipped} lines skipped ({why})"
    if data.skipped.get("other model"):
        text += (f"; the predictor was trained on the replies of {', '.join(map(str, models))}"
                 " and is evaluated on that model's history only")
    return text


def _skipped_text(data) -> str:
    """The history lines read_history skipped, by why: 'other model: 12, malformed: 1'."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(data.skipped.items()))


def _group_sizes(text: str) -> tuple[int, ...]:
    """--groups: whole numbers of at least 1, comma-separated."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise fail(f"--groups {text!r}: give group sizes as whole numbers of at least 1, "
                   "comma-separated (e.g. 1,8,32,128,256)")
    return sizes


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def _print_metrics(m: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{title}[/bold]")
    if not m.get("records"):
        return
    console.print(f"class accuracy {_pct(m['class_accuracy'])} (majority class "
                  f"{_pct(m['majority_class_accuracy'])}), mean abs error "
                  f"{m['mean_abs_error_tokens']} tokens, inference "
                  f"{m['inference_ms_per_request']} ms/request")
    # a group size with no full group (e.g. N=256 on fewer records) is left out
    sizes = [n for n, v in m["accumulated_error"].items() if v is not None]
    if not sizes:
        console.print(f"accumulated error: no group of N={', '.join(m['accumulated_error'])} "
                      f"in {m['records']} records (a group needs N of them)")
        return
    table = Table(title="accumulated error over groups of N requests (TD-Pipe Fig. 14)")
    table.add_column("predictor")
    for n in sizes:
        table.add_column(f"N={n}", justify="right")
    table.add_row("bert", *[_pct(m["accumulated_error"][n]) for n in sizes])
    table.add_row("mean", *[_pct(m["mean_baseline_accumulated_error"][n]) for n in sizes])
    console.print(table)


def _print_card(card: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cls, data = card["classes"], card["data"]
    console.print(f"[bold]trained {out}[/bold] on {data['records']} records "
                  f"({data['split']['train']}/{data['split']['val']}/{data['split']['test']}) in "
                  f"{card['training']['seconds']} s; model card: {out / 'README.md'}")
    table = Table(title="classes")
    for col in ("class", "range (tokens)", "mean", "train records"):
        table.add_column(col)
    for i, (rng, mean, n) in enumerate(zip(cls["ranges"], cls["means"], cls["train_counts"])):
        table.add_row(str(i), rng, f"{mean:g}", str(n))
    console.print(table)
    test = card["metrics"]["test"]
    if test.get("records"):
        _print_metrics(test, f"test split ({test['records']} records)")
