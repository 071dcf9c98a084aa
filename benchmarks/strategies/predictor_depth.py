"""How accurate the length predictor's head is on the [CLS] state of the encoder's first k layers,
reading the prompt's first `max_length` tokens (issue 43: a shallower encoder, or a narrower
input, would cut the predictor's cost; does it keep its accuracy?).

    python benchmarks/strategies/predictor_depth.py
    python benchmarks/strategies/predictor_depth.py --eval RUN_DIR [--eval RUN_DIR ...] --seeds 0 1 2
    python benchmarks/strategies/predictor_depth.py --depths 6 --max-lengths 64 128 256 \
        --truncations head head_tail --eval RUN_DIR

The training data and split are the shipped predictor's (examples/predictor_history and
examples/predictor_history_real, 60/20/20 with seed 0; by default the 256 head tokens it
reads). One encoder pass gives every layer's [CLS] state (a k-layer BERT's output is the full
one's k-th hidden state); for each depth and seed a head is trained exactly as `batchinfer
predictor train` trains one (head only, the best validation epoch), then scored on the test
split per prompt source and on each `--eval` run directory (e.g. the held-out BIG-bench run of
predictor_corpus.py). Prints JSON: per input width (max_length, truncation) and depth the class
accuracy and the accumulated error at N = 8 / 32 / 128 (TD-Pipe's Fig. 14) for each seed, their
median, and the seed the trainer's validation key picks (accuracy, then loss: what a user keeps
without seeing the test); the encoder's share of the work at that depth (linears and attention
scale with the layers), and the full encoder's measured milliseconds per prompt at that width on
each set (fp32, this host's threads).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO, emit, host_info  # noqa: E402

HISTORIES = (REPO / "examples" / "predictor_history", REPO / "examples" / "predictor_history_real")
GROUP_SIZES = (8, 32, 128)


def layer_states(encoder, tokenizer, texts: list[str], max_length: int, truncation: str):
    """((layers + 1, N, hidden): the [CLS] state after the embeddings and after each layer,
    milliseconds per text for the pass, tokenization included)."""
    import torch

    from batchinfer.predictors import bert

    start = time.perf_counter()
    tokens = bert.Tokenized(tokenizer, texts, max_length, truncation)
    layers = len(encoder.encoder.layer)
    out = torch.empty((layers + 1, len(texts), int(encoder.config.hidden_size)))
    with torch.inference_mode():
        for index in tokens.sorted_batches(64, bert.PADDED_TOKENS_PER_BATCH["cpu"]):
            ids, mask = tokens.batch(index, torch.device("cpu"))
            hidden = encoder(input_ids=ids, attention_mask=mask,
                             output_hidden_states=True).hidden_states
            rows = torch.as_tensor(index)
            for depth, state in enumerate(hidden):
                out[depth, rows] = state[:, 0]
    return out, 1000 * (time.perf_counter() - start) / max(len(texts), 1)


def score(head, states, records, means, edges) -> dict:
    import numpy as np
    import torch

    from batchinfer.predictors.base import cap
    from batchinfer.predictors.classes import accumulated_errors, accuracy, assign_classes

    with torch.no_grad():
        classes = head(states).argmax(-1).numpy()
    actual = np.array([r.output_tokens for r in records], dtype=np.float64)
    predicted = np.array([cap(means[c], r.max_tokens) for c, r in zip(classes, records)],
                         dtype=np.float64)
    errors = accumulated_errors(predicted, actual, GROUP_SIZES, rounds=20, seed=0)
    return {"records": len(records),
            "class_accuracy": round(accuracy(classes, assign_classes(actual, edges)), 4),
            **{f"error_N{n}": None if errors[str(n)] is None else round(errors[str(n)], 4)
               for n in GROUP_SIZES}}


def medians(per_seed: list[dict]) -> dict:
    out = {}
    for key in per_seed[0]:
        values = [s[key] for s in per_seed if s[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", action="append", type=Path, default=[],
                    help="a run directory (history.jsonl) to score on besides the test split")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="head initialisations and shuffles per depth")
    ap.add_argument("--depths", type=int, nargs="+", default=None,
                    help="encoder layers to try (default: 2 to all)")
    ap.add_argument("--max-lengths", type=int, nargs="+", default=None,
                    help="prompt tokens read (default: the shipped predictor's)")
    ap.add_argument("--truncations", nargs="+", default=None,
                    help="what a longer prompt keeps: head, head_tail (default: the shipped one)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from batchinfer.predictors import bert
    from batchinfer.predictors import train as training
    from batchinfer.predictors.classes import assign_classes, class_edges, class_means
    from batchinfer.predictors.history import read_history

    cfg = training.TrainConfig()
    records = [r for r in read_history(HISTORIES, need_text=True).records if r.prompt]
    train, val, test = training.split_records(records, cfg.fractions, cfg.seed)
    lengths = np.array([r.output_tokens for r in train], dtype=np.float64)
    edges = class_edges(lengths, cfg.percentiles)
    labels = assign_classes(lengths, edges)
    means = class_means(lengths, labels, len(edges), edges)
    y_val = assign_classes([r.output_tokens for r in val], edges)
    test_sets = {f"test:{source}": [r for r in test if training.source_name(r) == source]
                 for source in sorted({training.source_name(r) for r in test})}
    for run in args.eval:
        test_sets[f"eval:{run.name}"] = [r for r in read_history([run], need_text=True).records
                                         if r.prompt]

    encoder, tokenizer = bert.load_encoder()
    layers = len(encoder.encoder.layer)
    depths = args.depths or list(range(2, layers + 1))
    for depth in depths:
        if not 1 <= depth <= layers:
            raise SystemExit(f"--depths: {depth} is not between 1 and {layers}")
    for truncation in args.truncations or []:
        if truncation not in bert.TRUNCATIONS:
            raise SystemExit(f"--truncations: {truncation!r} is not one of {bert.TRUNCATIONS}")
    widths = [(n, t) for n in args.max_lengths or [cfg.max_length]
              for t in args.truncations or [cfg.truncation]]
    results = {}
    for max_length, truncation in widths:
        states = lambda part: layer_states(  # noqa: E731
            encoder, tokenizer, [r.prompt for r in part], max_length, truncation)
        (x_train, _), (x_val, _) = states(train), states(val)
        sets = {name: (part, *states(part)) for name, part in test_sets.items()}
        per_depth = {}
        for depth in depths:
            per_set = {name: [] for name in sets}
            validation = []
            for seed in args.seeds:
                torch.manual_seed(seed)
                model, _ = bert.build_classifier(len(edges), cfg.ffn_size, cfg.dropout,
                                                 cfg.pooling)
                best, curve, best_epoch = training.fit_head_on_states(
                    model, x_train[depth], torch.as_tensor(labels), x_val[depth],
                    torch.as_tensor(y_val), dataclasses.replace(cfg, seed=seed),
                    torch.device("cpu"))
                validation.append({k: curve[best_epoch - 1][k]
                                   for k in ("epoch", "val_loss", "val_accuracy")})
                model.head.load_state_dict(best)
                model.head.eval()
                for name, (part, x, _) in sets.items():
                    per_set[name].append(score(model.head, x[depth], part, means, edges))
            # the seed a user would keep without looking at the test: the trainer's own key for
            # epochs (validation accuracy, then loss) across the seeds too
            chosen = max(range(len(args.seeds)), key=lambda i: (validation[i]["val_accuracy"],
                                                                -validation[i]["val_loss"]))
            per_depth[str(depth)] = {
                "encoder_work_share": round(depth / layers, 3),
                "validation": validation, "validation_pick": args.seeds[chosen],
                **{name: {"median": medians(runs), "validation_pick": runs[chosen],
                          "seeds": runs} for name, runs in per_set.items()}}
        results[f"{max_length}/{truncation}"] = {
            "encoder_ms_per_prompt": {name: round(ms, 2) for name, (_, _, ms) in sets.items()},
            "depths": per_depth}
    emit({"benchmark": "predictor_depth", "host": host_info(),
          "threads": torch.get_num_threads(),
          "training": {"histories": [str(p.relative_to(REPO)) for p in HISTORIES],
                       "records": len(records), "train": len(train), "val": len(val),
                       "test": len(test), "pooling": cfg.pooling},
          "seeds": args.seeds, "results": results})

if __name__ == "__main__":
    main()
