"""Length classes and the metrics of TD-Pipe §3.3 / Fig. 14, as pure functions over numbers.

Classes are ranges between percentiles of the training output lengths: with the default
percentiles (0, 25, 50, 75, 99) the classes are [P0,P25), [P25,P50), [P50,P75), [P75,P99),
[P99,inf). A class's predicted length is the mean training length inside it (μ-Serve's rule).
Percentiles that coincide (many outputs of exactly the same length, e.g. every long answer cut
at max_tokens) would leave an empty class, so duplicate edges are merged: fewer, non-empty classes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (0.0, 25.0, 50.0, 75.0, 99.0)
DEFAULT_GROUP_SIZES: tuple[int, ...] = (1, 8, 32, 128, 256)


def check_percentiles(percentiles: Sequence[float]) -> tuple[float, ...]:
    """Strictly increasing, within [0, 100), starting at 0 (so every length has a class)."""
    values = tuple(float(p) for p in percentiles)
    if len(values) < 2:
        raise ValueError(f"need at least 2 percentiles (2 classes), got {list(values)}")
    if values[0] != 0.0:
        raise ValueError(f"the first percentile must be 0 (the lowest class starts at P0), got "
                         f"{values[0]:g}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"percentiles must be strictly increasing, got {list(values)}")
    if values[-1] >= 100.0:
        raise ValueError(f"percentiles must be below 100 (the last class is [P_last, inf)), got "
                         f"{values[-1]:g}")
    return values


def class_edges(lengths: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
                ) -> list[float]:
    """Lower edge of each class: the percentiles of `lengths`, duplicates merged."""
    return [edge for edge, _ in _edges(lengths, percentiles)]


def edge_percentiles(lengths: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
                     ) -> list[float]:
    """The percentile each kept edge came from (the first one, where several coincide)."""
    return [p for _, p in _edges(lengths, percentiles)]


def _edges(lengths: Sequence[float], percentiles: Sequence[float]) -> list[tuple[float, float]]:
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no lengths to compute classes from")
    wanted = check_percentiles(percentiles)
    out: list[tuple[float, float]] = []
    for edge, p in zip(np.percentile(arr, wanted), wanted):
        if not out or edge > out[-1][0]:
            out.append((float(edge), p))
    return out


def assign_classes(lengths: Sequence[float], edges: Sequence[float]) -> np.ndarray:
    """Class index of each length: i such that edges[i] <= length < edges[i+1] (last: open)."""
    arr = np.asarray(lengths, dtype=np.float64)
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), arr, side="right") - 1
    return np.clip(idx, 0, len(edges) - 1).astype(np.int64)


def class_means(lengths: Sequence[float], labels: Sequence[int], num_classes: int,
                edges: Optional[Sequence[float]] = None) -> list[float]:
    """Mean length of each class. An empty class (possible on data other than the one the edges
    came from) gets its lower edge, or 0 without edges."""
    arr = np.asarray(lengths, dtype=np.float64)
    lab = np.asarray(labels, dtype=np.int64)
    means = []
    for k in range(num_classes):
        members = arr[lab == k]
        if members.size:
            means.append(float(members.mean()))
        else:
            means.append(float(edges[k]) if edges is not None else 0.0)
    return means


MIN_TAIL_EVENTS = 20     # outputs that ended above tail_from: fewer leave the tail's mean noise


def cut_tail(lengths: Sequence[float], labels: Sequence[int], num_classes: int,
             edges: Sequence[float], cut: Sequence[bool]) -> Optional[dict]:
    """What the training outputs cut before their end (`cut`: finish reason `length`, at their
    max_tokens or the model's length limit; each one's length is where it stopped) say past
    where they stopped. Counted there, a cut output makes its class's mean a floor that holds
    only for requests capped as the training was: the shipped history, generated with max_tokens
    512, puts its top class at exactly 512, and a job that allows 1,024 tokens was forecast 512
    for replies that, reaching 512, averaged 941 there. Past its stop the length is read as
    exponential (memoryless), its mean `tail_mean` fitted by censored maximum likelihood to the
    outputs above `tail_from`, the highest class edge below every stop that leaves at least
    MIN_TAIL_EVENTS outputs ending above it: the tokens every output spent above it (to its end
    or its stop) over the outputs that ended there. -> {"cap": the lowest stop, "cut",
    "tail_from", "tail_mean", per class "members", "uncut_mean" and "cut_at" ([stop, count]
    pairs)}, or None when nothing was cut or too few outputs ended above any edge. An
    exponential tail is a floor too where cut replies are runaway generations: on the shipped
    model's 1,024-cap job it gives 775 tokens for replies reaching 512, which averaged 941."""
    arr = np.asarray(lengths, dtype=np.float64)
    was_cut = np.asarray(cut, dtype=bool)
    if not was_cut.any():
        return None
    lowest = float(arr[was_cut].min())
    for t in sorted((float(e) for e in edges if e < lowest), reverse=True):
        above = arr >= t
        ended = int((above & ~was_cut).sum())
        if ended >= MIN_TAIL_EVENTS:
            break
    else:
        return None
    exposure = float((arr[above] - t).sum())
    lab = np.asarray(labels, dtype=np.int64)
    members, uncut, cut_at = [], [], []
    for k in range(num_classes):
        mine = lab == k
        kept = arr[mine & ~was_cut]
        stops, counts = np.unique(arr[mine & was_cut], return_counts=True)
        members.append(int(mine.sum()))
        uncut.append(round(float(kept.mean()), 3) if kept.size else 0.0)
        cut_at.append([[float(s), int(c)] for s, c in zip(stops, counts)])
    return {"cap": lowest, "cut": int(was_cut.sum()), "tail_from": t,
            "tail_mean": round(exposure / ended, 3), "members": members, "uncut_mean": uncut,
            "cut_at": cut_at}


def means_past_cap(means: Sequence[float], tail: Optional[dict],
                   max_tokens: Optional[int]) -> list[float]:
    """The class means for a request of `max_tokens` (None: unbounded): `means` where that is
    within the lowest stop of the training's cut outputs (or nothing was cut), else each class's
    cut outputs counted as E[min(stop + an exponential tail of mean tail_mean, max_tokens)]
    (cut_tail; a stop at or past max_tokens as the stop), its others as their mean."""
    if tail is None or (max_tokens is not None and max_tokens <= tail["cap"]):
        return [float(m) for m in means]
    limit = np.inf if max_tokens is None else float(max_tokens)
    mu = tail["tail_mean"]
    out = []
    for mean, n, uncut, stops in zip(means, tail["members"], tail["uncut_mean"],
                                     tail["cut_at"]):
        if not stops or not n:
            out.append(float(mean))
            continue
        past = sum(count * (stop if stop >= limit else stop + mu * -np.expm1(-(limit - stop) / mu))
                   for stop, count in stops)
        out.append(float(((n - sum(c for _, c in stops)) * uncut + past) / n))
    return out


def class_counts(labels: Sequence[int], num_classes: int) -> list[int]:
    return [int(c) for c in np.bincount(np.asarray(labels, dtype=np.int64),
                                        minlength=num_classes)[:num_classes]]


def class_ranges(edges: Sequence[float]) -> list[str]:
    """Human-readable ranges, e.g. ['[1, 12)', '[12, 40)', '[40, inf)']."""
    out = []
    for i, lo in enumerate(edges):
        hi = f"{edges[i + 1]:g}" if i + 1 < len(edges) else "inf"
        out.append(f"[{lo:g}, {hi})")
    return out


def accuracy(predicted: Sequence[int], actual: Sequence[int]) -> float:
    p, a = np.asarray(predicted), np.asarray(actual)
    if p.size == 0:
        return float("nan")
    return float((p == a).mean())


def majority_accuracy(train_labels: Sequence[int], eval_labels: Sequence[int],
                      num_classes: int) -> float:
    """Accuracy of always answering the most common training class."""
    majority = int(np.argmax(class_counts(train_labels, num_classes)))
    return accuracy(np.full(len(eval_labels), majority), eval_labels)


def accumulated_error(predicted: Sequence[float], actual: Sequence[float], group_size: int,
                      rounds: int = 1, seed: Optional[int] = None) -> Optional[float]:
    """TD-Pipe Fig. 14: the mean, over groups of `group_size` requests, of
    |sum(predicted) - sum(actual)| / sum(actual).

    Groups are consecutive, disjoint slices; a last partial group is dropped. With `seed` the
    requests are shuffled first, and `rounds` > 1 repeats that with fresh shuffles and averages
    all groups (same expectation, less noise when the test set holds only a few groups).
    None when there are fewer requests than `group_size`.
    """
    pred = np.asarray(predicted, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    if pred.shape != act.shape:
        raise ValueError(f"{pred.size} predictions for {act.size} actual lengths")
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    groups = act.size // group_size
    if groups == 0:
        return None
    rng = np.random.default_rng(seed) if seed is not None else None
    errors = []
    for _ in range(max(rounds, 1) if rng is not None else 1):
        order = rng.permutation(act.size) if rng is not None else np.arange(act.size)
        keep = order[:groups * group_size].reshape(groups, group_size)
        p_sum, a_sum = pred[keep].sum(axis=1), act[keep].sum(axis=1)
        errors.append(np.abs(p_sum - a_sum) / np.maximum(a_sum, 1.0))
    return float(np.concatenate(errors).mean())


def accumulated_errors(predicted: Sequence[float], actual: Sequence[float],
                       group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES, rounds: int = 1,
                       seed: Optional[int] = None) -> dict[str, Optional[float]]:
    """{"N": error} for each group size (None where the data holds no full group)."""
    return {str(n): accumulated_error(predicted, actual, n, rounds=rounds, seed=seed)
            for n in group_sizes}
