"""Training and evaluating the BERT length predictor on the runner's own history.

As in TD-Pipe §4.1: the history is split 60/20/20 (seeded) into train / validation / test;
classes and class means come from the training outputs only; the head (and optionally the top
encoder layers) trains with cross-entropy, the epoch with the best validation accuracy is kept,
and the test split gives the numbers in the model card: per-request class accuracy (against the
majority-class baseline) and Fig. 14's accumulated error over groups of N requests.

With the encoder frozen (the default) its pooled states are computed once and only the small
head trains, so training on a few thousand prompts takes seconds after one encoder pass.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from . import bert
from .base import PREDICTOR_CARD, PredictorError, cap
from .classes import (DEFAULT_GROUP_SIZES, DEFAULT_PERCENTILES, accumulated_errors, accuracy,
                      assign_classes, check_percentiles, class_counts, class_edges, class_means,
                      class_ranges, cut_tail, edge_percentiles, means_past_cap)
from .history import HistoryRecord

log = logging.getLogger(__name__)

MIN_RECORDS = 50          # below this a 60/20/20 split leaves ~10 records to validate and test on
SPLIT_FILE = "split.json"
CARD_MD = "README.md"


@dataclass
class TrainConfig:
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)
    seed: int = 0
    epochs: int = 40
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-2
    ffn_size: int = 256
    dropout: float = 0.1
    train_layers: int = 0           # top encoder layers fine-tuned with the head (0: head only)
    encoder_lr: float = 3e-5
    max_length: int = 256           # prompt tokens read (BERT's limit is 512: measured no better)
    truncation: str = "head"        # what a longer prompt keeps: head, or head_tail (bert.py)
    pooling: str = "cls"            # cls: the paper's [CLS] state; mean: mean over tokens
    device: Optional[str] = None
    group_sizes: tuple[int, ...] = DEFAULT_GROUP_SIZES
    error_rounds: int = 20          # shuffles averaged in the accumulated error


def split_records(records: Sequence[HistoryRecord], fractions=(0.6, 0.2, 0.2), seed: int = 0
                  ) -> tuple[list[HistoryRecord], list[HistoryRecord], list[HistoryRecord]]:
    """A seeded shuffle cut into train / validation / test by `fractions`."""
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise PredictorError(f"split fractions must be three positive numbers summing to 1, got "
                             f"{list(fractions)}")
    order = np.random.default_rng(seed).permutation(len(records))
    n_train = int(round(fractions[0] * len(records)))
    n_val = int(round(fractions[1] * len(records)))
    pick = lambda idx: [records[i] for i in idx]  # noqa: E731
    return (pick(order[:n_train]), pick(order[n_train:n_train + n_val]),
            pick(order[n_train + n_val:]))


def check_enough(n: int, minimum: int = MIN_RECORDS) -> None:
    if n < minimum:
        raise PredictorError(f"too little history to train on: {n} usable records, at least "
                             f"{minimum} are needed (run more requests with `batchinfer run`, "
                             "then pass every run directory to --history)")


# --- training -------------------------------------------------------------------------------------
def fit_head_on_states(model: bert.BertLengthClassifier, x_train: torch.Tensor,
                       y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                       cfg: TrainConfig, device: torch.device) -> tuple[dict, list[dict], int]:
    """Head-only training on precomputed encoder states; returns the best head state."""
    head = model.head.to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(cfg.seed)
    x_train, y_train = x_train.to(device), y_train.to(device)
    x_val, y_val = x_val.to(device), y_val.to(device)
    best, best_key, best_epoch, curve = None, None, 0, []
    for epoch in range(1, cfg.epochs + 1):
        head.train()
        total = 0.0
        for idx in torch.randperm(len(x_train), generator=gen).split(cfg.batch_size):
            idx = idx.to(device)
            opt.zero_grad()
            loss = loss_fn(head(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        head.eval()
        with torch.no_grad():
            logits = head(x_val)
            val_loss = float(loss_fn(logits, y_val)) if len(y_val) else 0.0
            val_acc = float((logits.argmax(-1) == y_val).float().mean()) if len(y_val) else 0.0
        curve.append({"epoch": epoch, "train_loss": round(total / max(len(x_train), 1), 5),
                      "val_loss": round(val_loss, 5), "val_accuracy": round(val_acc, 5)})
        key = (val_acc, -val_loss)
        if best_key is None or key > best_key:
            best_key, best_epoch = key, epoch
            best = copy.deepcopy(head.state_dict())
    return best, curve, best_epoch


def _fit_with_encoder(model: bert.BertLengthClassifier, tokenizer, train_texts, y_train,
                      val_texts, y_val, cfg: TrainConfig, device: torch.device
                      ) -> tuple[dict, list[dict], int]:
    """Head plus the top `train_layers` encoder layers, a full forward per batch."""
    model.set_trainable_layers(cfg.train_layers)
    model.to(device)
    params = [{"params": model.head.parameters(), "lr": cfg.lr},
              {"params": [p for p in model.encoder.parameters() if p.requires_grad],
               "lr": cfg.encoder_lr}]
    opt = torch.optim.AdamW(params, weight_decay=cfg.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(cfg.seed)
    train_tok = bert.Tokenized(tokenizer, train_texts, cfg.max_length, cfg.truncation)
    val_tok = bert.Tokenized(tokenizer, val_texts, cfg.max_length, cfg.truncation)
    y = torch.as_tensor(y_train, dtype=torch.long)
    best, best_key, best_epoch, curve = None, None, 0, []
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        total = 0.0
        for idx in torch.randperm(len(train_tok), generator=gen).split(cfg.batch_size):
            ids, mask = train_tok.batch(idx.tolist(), device)
            opt.zero_grad()
            loss = loss_fn(model(ids, mask), y[idx].to(device))
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        pred = bert.predict_class_ids(model, val_tok, cfg.batch_size, device)
        val_acc = accuracy(pred, y_val) if len(y_val) else 0.0
        curve.append({"epoch": epoch, "train_loss": round(total / max(len(train_tok), 1), 5),
                      "val_accuracy": round(val_acc, 5)})
        if best_key is None or val_acc > best_key:
            best_key, best_epoch = val_acc, epoch
            best = copy.deepcopy(model.state_dict())
    return best, curve, best_epoch


def train_predictor(records: Sequence[HistoryRecord], out_dir: Path,
                    cfg: Optional[TrainConfig] = None, sources: Sequence[str] = (),
                    skipped: Optional[dict] = None) -> "bert.BertLengthPredictor":
    """Trains on `records`, writes the predictor directory, returns the trained predictor (its
    `card` is what predictor.json holds)."""
    cfg = cfg or TrainConfig()
    try:
        percentiles = check_percentiles(cfg.percentiles)
    except ValueError as exc:
        raise PredictorError(f"--percentiles: {exc}") from None
    records = [r for r in records if r.prompt]
    check_enough(len(records))
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    device = bert.resolve_device(cfg.device)
    train, val, test = split_records(records, cfg.fractions, cfg.seed)
    lengths = np.array([r.output_tokens for r in train], dtype=np.float64)
    edges = class_edges(lengths, percentiles)
    k = len(edges)
    labels = assign_classes(lengths, edges)
    means = class_means(lengths, labels, k, edges)
    # outputs cut at max_tokens: what a request allowed more tokens is forecast (classes.py)
    tail = cut_tail(lengths, labels, k, edges, [r.cut for r in train])
    y_val = assign_classes([r.output_tokens for r in val], edges)
    if k < len(percentiles):
        log.warning("%d of the %d percentiles coincide on this history (many outputs of the same "
                    "length): training %d classes %s", len(percentiles) - k, len(percentiles), k,
                    class_ranges(edges))

    model, tokenizer = bert.build_classifier(k, cfg.ffn_size, cfg.dropout, cfg.pooling)
    if cfg.train_layers:
        best, curve, best_epoch = _fit_with_encoder(
            model, tokenizer, [r.prompt for r in train], labels, [r.prompt for r in val], y_val,
            cfg, device)
        model.load_state_dict(best)
    else:
        model.to(device)
        states = {}
        for name, part in (("train", train), ("val", val)):
            tokens = bert.Tokenized(tokenizer, [r.prompt for r in part], cfg.max_length,
                                     cfg.truncation)
            states[name] = bert.pooled_states(model, tokens, cfg.batch_size, device)
        best, curve, best_epoch = fit_head_on_states(
            model, states["train"], torch.as_tensor(labels), states["val"],
            torch.as_tensor(y_val), cfg, device)
        model.head.load_state_dict(best)
    train_s = time.perf_counter() - t0
    model.eval()

    out_dir = Path(out_dir)
    counts = class_counts(labels, k)
    card = {
        "format_version": bert.FORMAT_VERSION,
        "kind": "bert",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "batchinfer_version": _version(),
        "encoder": {"name": bert.ENCODER_NAME, "package": bert.ENCODER_DIST,
                    "package_version": bert.encoder_version(), "pooling": cfg.pooling,
                    "max_length": cfg.max_length, "truncation": cfg.truncation,
                    "hidden_size": model.hidden_size,
                    "train_layers": cfg.train_layers},
        "head": {"ffn_size": cfg.ffn_size, "num_classes": k, "dropout": cfg.dropout},
        "classes": {"percentiles": list(percentiles),
                    "edge_percentiles": edge_percentiles(lengths, percentiles), "edges": edges,
                    "ranges": class_ranges(edges), "means": [round(m, 3) for m in means],
                    "train_counts": counts, "train_mean": round(float(lengths.mean()), 3),
                    "majority_class": int(np.argmax(counts)), "cut_tail": tail},
        "data": {"sources": [str(s) for s in sources], "records": len(records),
                 "prompt_sources": sorted({source_name(r) for r in train}),
                 "skipped": dict(skipped or {}),
                 "models": sorted({str(r.model) for r in records}),
                 "split": {"fractions": list(cfg.fractions), "seed": cfg.seed,
                           "train": len(train), "val": len(val), "test": len(test)}},
        "training": {**{k_: v for k_, v in asdict(cfg).items()
                        if k_ not in ("percentiles", "fractions", "group_sizes")},
                     "device": str(device), "best_epoch": best_epoch,
                     "seconds": round(train_s, 2), "curve": curve},
    }
    predictor = bert.BertLengthPredictor(model, tokenizer, card, device=cfg.device,
                                         batch_size=cfg.batch_size)
    card["metrics"] = {
        "val": evaluate(predictor, val, cfg.group_sizes, cfg.error_rounds, cfg.seed),
        "test": evaluate(predictor, test, cfg.group_sizes, cfg.error_rounds, cfg.seed),
    }
    # the files last, the card after the weights and split it describes: a directory that held
    # a predictor is untouched until then, and a write cut short leaves no card beside another
    # predictor's weights (a directory without predictor.json is refused by name)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PREDICTOR_CARD).unlink(missing_ok=True)
    bert.save_weights(out_dir, model, cfg.train_layers)
    (out_dir / SPLIT_FILE).write_text(json.dumps(
        {name: [list(r.key) for r in part] for name, part in
         (("train", train), ("val", val), ("test", test))}) + "\n", encoding="utf-8")
    write_card(out_dir, card)
    return predictor


def _version() -> str:
    from batchinfer import __version__

    return __version__


# --- evaluation -----------------------------------------------------------------------------------
def evaluate(predictor: "bert.BertLengthPredictor", records: Sequence[HistoryRecord],
             group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES, rounds: int = 20,
             seed: int = 0) -> dict:
    """Class accuracy, majority baseline, accumulated error (and the mean predictor's, for
    reference) and inference cost of `predictor` on `records`."""
    card = predictor.card
    classes = card["classes"]
    edges, means = classes["edges"], classes["means"]
    # a canonical order, so the shuffled groups do not depend on how the records were listed
    records = sorted((r for r in records if r.prompt), key=lambda r: r.key)
    if not records:
        return {"records": 0}
    actual = np.array([r.output_tokens for r in records], dtype=np.float64)
    predictor.predict_class_ids([records[0].prompt])        # warm-up: first-call overheads
    t = time.perf_counter()
    predicted_class = predictor.predict_class_ids([r.prompt for r in records])
    infer_s = time.perf_counter() - t
    tail = classes.get("cut_tail")
    predicted = np.array([cap(means_past_cap(means, tail, r.max_tokens)[c], r.max_tokens)
                          for c, r in zip(predicted_class, records)], dtype=np.float64)
    true_class = assign_classes(actual, edges)
    k = len(edges)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (true_class, predicted_class), 1)
    mean_pred = np.array([cap(classes["train_mean"], r.max_tokens) for r in records],
                         dtype=np.float64)
    return {
        "records": len(records),
        "class_accuracy": round(accuracy(predicted_class, true_class), 4),
        "majority_class_accuracy": round(accuracy(np.full(len(records), classes["majority_class"]),
                                                  true_class), 4),
        "accumulated_error": _rounded(accumulated_errors(predicted, actual, group_sizes, rounds,
                                                         seed)),
        "mean_baseline_accumulated_error": _rounded(accumulated_errors(
            mean_pred, actual, group_sizes, rounds, seed)),
        "mean_abs_error_tokens": round(float(np.abs(predicted - actual).mean()), 2),
        "actual_mean_tokens": round(float(actual.mean()), 2),
        "predicted_mean_tokens": round(float(predicted.mean()), 2),
        "confusion": confusion.tolist(),
        "inference_s": round(infer_s, 4),
        "inference_ms_per_request": round(1e3 * infer_s / len(records), 4),
    }


NO_SOURCE = "-"


def source_name(record: HistoryRecord) -> str:
    return record.source if record.source else NO_SOURCE


def training_sources(card: dict, records: Sequence[HistoryRecord], split: dict
                     ) -> Optional[set[str]]:
    """The prompt sources the predictor was trained on: its card's (predictors trained since
    issue 43 record them), else those of its training records found in `records`; None when
    neither says."""
    listed = (card.get("data") or {}).get("prompt_sources")
    if listed:
        return set(listed)
    train = split.get("train", set())
    found = {source_name(r) for r in records if r.key in train}
    return found or None


def evaluate_by_source(predictor: "bert.BertLengthPredictor", records: Sequence[HistoryRecord],
                       trained_on: Optional[set[str]],
                       group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES, rounds: int = 20,
                       seed: int = 0) -> dict:
    """`evaluate` per prompt source (a record's `source`), and over the sources the predictor
    was trained on (in distribution) and over the others (out of distribution)."""
    by: dict[str, list[HistoryRecord]] = {}
    for r in records:
        by.setdefault(source_name(r), []).append(r)
    out: dict = {"sources": {}}
    for name in sorted(by):
        m = evaluate(predictor, by[name], group_sizes, rounds, seed)
        m["in_distribution"] = None if trained_on is None else name in trained_on
        out["sources"][name] = m
    if trained_on is not None:
        for label, keep in (("in_distribution", True), ("out_of_distribution", False)):
            part = [r for r in records if (source_name(r) in trained_on) == keep]
            if part:
                out[label] = evaluate(predictor, part, group_sizes, rounds, seed)
    return out


def _rounded(errors: dict) -> dict:
    return {n: (None if v is None else round(v, 5)) for n, v in errors.items()}


def load_split(path: Path) -> Optional[dict[str, set[tuple[str, str]]]]:
    """The records a predictor trained and validated on (split.json); None where the file is
    missing or unreadable: which records it saw is then unknown."""
    try:
        raw = json.loads((Path(path) / SPLIT_FILE).read_text(encoding="utf-8"))
        return {name: {tuple(k) for k in keys} for name, keys in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def held_out(records: Sequence[HistoryRecord], split: dict) -> list[HistoryRecord]:
    """Records the predictor neither trained nor selected its epoch on."""
    seen = split.get("train", set()) | split.get("val", set())
    return [r for r in records if r.key not in seen]


# --- the model card -------------------------------------------------------------------------------
def write_card(out_dir: Path, card: dict) -> None:
    (Path(out_dir) / PREDICTOR_CARD).write_text(json.dumps(card, indent=2) + "\n",
                                                encoding="utf-8")
    (Path(out_dir) / CARD_MD).write_text(render_card(card), encoding="utf-8")


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def _reads(enc: dict) -> str:
    n = enc.get("max_length", 512)
    if enc.get("truncation", "head") == "head_tail":
        return f"a prompt's first and last {n // 2} tokens (all of a shorter one)"
    return f"a prompt's first {n} tokens"


def render_card(card: dict) -> str:
    enc, cls, data, tr = card["encoder"], card["classes"], card["data"], card["training"]
    test = (card.get("metrics") or {}).get("test") or {}
    lines = [
        "# Output-length predictor (BERT classifier)", "",
        f"TD-Pipe §3.3 / μ-Serve: the {'[CLS]' if enc['pooling'] == 'cls' else 'mean-pooled'} "
        f"final-layer state of {enc['name']} ({enc['package']} "
        f"{enc.get('package_version') or '?'}) over {_reads(enc)} -> two-layer FFN ({card['head']['ffn_size']} "
        f"hidden) -> one of {card['head']['num_classes']} length classes; the prediction is the "
        "class's training mean, capped at the request's max_tokens.", "",
        "Use it in a recipe:", "", "    predictor:", "      name: bert",
        "      path: <this directory>", "",
        "## Data", "",
        f"{data['records']} history records from {', '.join(data['sources']) or '?'} "
        f"(models: {', '.join(data['models'])}); split {data['split']['train']} / "
        f"{data['split']['val']} / {data['split']['test']} (train / val / test, seed "
        f"{data['split']['seed']}).",
    ]
    if data.get("skipped"):
        lines.append("Skipped: " + ", ".join(f"{k} {v}" for k, v in data["skipped"].items()) + ".")
    lines += ["", "## Classes (from the training outputs)", "",
              "| class | percentiles | range (tokens) | mean | train records |",
              "|---|---|---|---|---|"]
    pcts = cls["edge_percentiles"]
    for i, (rng, mean, n) in enumerate(zip(cls["ranges"], cls["means"], cls["train_counts"])):
        upper = f"P{pcts[i + 1]:g}" if i + 1 < len(pcts) else "inf"
        lines.append(f"| {i} | [P{pcts[i]:g}, {upper}) | {rng} | {mean:g} | {n} |")
    lines += ["", f"Training mean: {cls['train_mean']:g} tokens."]
    tail = cls.get("cut_tail")
    if tail:
        lines.append(f"{tail['cut']} training outputs were cut (the first at {tail['cap']:g} "
                     f"tokens); for a request allowed more, each counts as where it stopped "
                     f"plus an exponential tail of mean {tail['tail_mean']:g} tokens (fitted to "
                     f"the outputs above {tail['tail_from']:g}), capped at its max_tokens.")
    lines += ["", "## Test metrics", ""]
    if test.get("records"):
        lines += [f"- records: {test['records']}",
                  f"- class accuracy: {_pct(test['class_accuracy'])} (majority class: "
                  f"{_pct(test['majority_class_accuracy'])})",
                  f"- mean absolute error: {test['mean_abs_error_tokens']} tokens",
                  f"- inference: {test['inference_ms_per_request']} ms per request", "",
                  "Accumulated error (Fig. 14: mean over groups of N of |sum predicted - sum "
                  "actual| / sum actual):", "",
                  "| N | " + " | ".join(test["accumulated_error"]) + " |",
                  "|---|" + "---|" * len(test["accumulated_error"]),
                  "| BERT | " + " | ".join(_pct(v) for v in test["accumulated_error"].values())
                  + " |",
                  "| mean | " + " | ".join(_pct(v) for v in
                                          test["mean_baseline_accumulated_error"].values()) + " |"]
    else:
        lines.append("(no test records)")
    lines += ["", "## Training", "",
              f"{tr['epochs']} epochs (best: {tr['best_epoch']}), lr {tr['lr']}, batch "
              f"{tr['batch_size']}, encoder layers fine-tuned: {tr['train_layers']}, seed "
              f"{tr['seed']}, device {tr['device']}, {tr['seconds']} s.", ""]
    return "\n".join(lines)
