"""Fits profile_table.RankCompute's per-layer model to measured forward times.

Every measured micro-batch gives one equation (per decoder layer):

    seconds / layers = dense(tokens) + per_seq_s * seqs
                       + attn_decode(decode_seqs) * decode_context + attn_prefill_s * prefill_pairs

with `dense` piecewise linear over knots at the measured token counts, written as non-negative
increments from one knot to the next (so the equations stay linear and `dense` can only grow
with the token count), and `attn_decode` piecewise linear over knots at the measured decode
batch sizes, written as non-negative increments from the largest batch down (hat weights times
the context: still linear; a context token never costs more in a bigger batch, which keeps one
noisy point from bending the table). Non-negative least squares on relative errors (each row divided by its
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
    """points: {"tokens", "seqs", "decode_seqs", "decode_context", "prefill_pairs", "seconds"}
    per measured micro-batch (seconds: the whole model's forward)."""
    if not points:
        raise ValueError("no measured micro-batches to fit")
    knots = sorted({int(p["tokens"]) for p in points})
    decode_knots = sorted({int(p["decode_seqs"]) for p in points if p["decode_context"]}) or [1]
    rows, target = [], []
    for p in points:
        per_layer = p["seconds"] / num_layers
        hat = _hat_row(knots, p["tokens"])
        # dense(x) = sum_i hat_i(x) * sum_{j<=i} step_j = sum_j step_j * sum_{i>=j} hat_i(x)
        steps = [sum(hat[j:]) for j in range(len(knots))]
        hat = _hat_row(decode_knots, max(p["decode_seqs"], 1))
        # attn(b) = sum_i hat_i(b) * sum_{j>=i} up_j = sum_j up_j * sum_{i<=j} hat_i(b)
        attn = [sum(hat[:j + 1]) * p["decode_context"] for j in range(len(decode_knots))]
        row = steps + attn + [p["seqs"], p["prefill_pairs"]]
        rows.append([v / per_layer for v in row])
        target.append(1.0)
    solution, _ = nnls(np.asarray(rows), np.asarray(target))
    n, m = len(knots), len(decode_knots)
    dense_values = np.cumsum(solution[:n])
    attn_values = np.cumsum(solution[n:n + m][::-1])[::-1]
    attn_decode = [(k, float(v)) for k, v in zip(decode_knots, attn_values)]
    per_seq, attn_prefill = (float(v) for v in solution[n + m:])
    compute = RankCompute(list(zip(knots, (float(v) for v in dense_values))), per_seq,
                          attn_decode, attn_prefill, lm_head, sampling)
    for p in points:
        fitted = num_layers * compute.layer_seconds(p["tokens"], p["seqs"], p["decode_seqs"],
                                                    p["decode_context"], p["prefill_pairs"])
        compute.points.append({**p, "fitted_seconds": fitted})
    return compute
