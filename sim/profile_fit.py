"""Fits profile_table.RankCompute's per-layer model to measured forward times.

Every measured micro-batch gives one equation (per decoder layer):

    seconds / layers = dense(tokens) + per_seq_s * seqs + attn_decode_s * decode_context
                       + attn_prefill_s * prefill_pairs

with `dense` piecewise linear over knots at the measured token counts, written as non-negative
increments from one knot to the next (so the equations stay linear and `dense` can only grow
with the token count). Non-negative least squares on relative errors (each row divided by its
own time: a 2 ms decode step matters as much as a 2 s prefill) gives the increments and the
three coefficients.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from .profile_table import RankCompute


def _hat_row(knots: list[int], x: float) -> list[float]:
    """Weights of each knot in the piecewise-linear value at x (constant beyond the ends)."""
    row = [0.0] * len(knots)
    if x <= knots[0]:
        row[0] = 1.0
    elif x >= knots[-1]:
        row[-1] = 1.0
    else:
        for i in range(len(knots) - 1):
            if knots[i] <= x <= knots[i + 1]:
                w = (x - knots[i]) / (knots[i + 1] - knots[i])
                row[i], row[i + 1] = 1.0 - w, w
                break
    return row


def fit_rank_compute(points: list[dict], num_layers: int, lm_head: list[tuple[int, float]],
                     sampling: list[tuple[int, float]]) -> RankCompute:
    """points: {"tokens", "seqs", "decode_context", "prefill_pairs", "seconds"} per measured
    micro-batch (seconds: the whole model's forward)."""
    if not points:
        raise ValueError("no measured micro-batches to fit")
    knots = sorted({int(p["tokens"]) for p in points})
    rows, target = [], []
    for p in points:
        per_layer = p["seconds"] / num_layers
        hat = _hat_row(knots, p["tokens"])
        # dense(x) = sum_i hat_i(x) * sum_{j<=i} step_j = sum_j step_j * sum_{i>=j} hat_i(x)
        steps = [sum(hat[j:]) for j in range(len(knots))]
        row = steps + [p["seqs"], p["decode_context"], p["prefill_pairs"]]
        rows.append([v / per_layer for v in row])
        target.append(1.0)
    solution, _ = nnls(np.asarray(rows), np.asarray(target))
    dense_values = np.cumsum(solution[: len(knots)])
    per_seq, attn_decode, attn_prefill = (float(v) for v in solution[len(knots):])
    compute = RankCompute(list(zip(knots, (float(v) for v in dense_values))), per_seq,
                          attn_decode, attn_prefill, lm_head, sampling)
    for p in points:
        fitted = num_layers * compute.layer_seconds(p["tokens"], p["seqs"], p["decode_context"],
                                                    p["prefill_pairs"])
        compute.points.append({**p, "fitted_seconds": fitted})
    return compute
