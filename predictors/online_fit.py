"""The arithmetic of learning from the running job (predictors/online.py), as pure numpy functions.

A job's finished requests are labelled examples: the prior's forecast o_i (the shipped
predictor's class mean), its class c_i, its encoder embedding x_i, and the actual length y_i.
Fitting is three small steps, each sound with few examples because each shrinks to the prior:

1. **Global scale** s: sum(y) / sum(o), with `prior_weight` pseudo-examples at ratio 1
   (s = (sum y + tau * mean o) / (sum o + tau * mean o)): a job whose replies are all longer
   or shorter than the prior's training data moves every class at once. The first replies to
   finish are the short ones, so the requests still decoding count too, both sides truncated
   at how far each request has been watched (`global_scale`'s censored moment match).
2. **Class means** (μ-Serve's rule, recalibrated on the job): m_k' = (sum of y in class k +
   tau * s * m_k) / (n_k + tau): the prior's class mean, rescaled, is worth `tau` examples.
   With requests still decoding (censored at g tokens), `impute="job"` (the default) reads each
   class's lengths as exponential with a conjugate prior: m_k' = (exposure_k + tau' * s * m_k) /
   (finished_k + tau'), exposure the tokens every request of the class was watched for
   (`censored_means`), tau' = `tail_weight` prior events. It is the fixed point of labelling a
   decoding request with g + its class's own recalibrated mean; `impute="prior"` (the earlier
   rule) labels it g + s * m_k instead, which pins the unseen tails to the prior's class means:
   on a source where the prior's classes do not separate the lengths (BIG-bench, held out: every
   class's replies average 140-190 tokens against prior means 25-512), a class the prior put at
   280 was relearned at 318 from its own decoding requests while its replies averaged 191.
3. **Ridge head on the cached embeddings** for what is left, r_i = y_i - m'_{c_i}:
   w = argmin |r - Xw|^2 + lam |w|^2 on standardised embeddings, with lam chosen by exact
   leave-one-out error over a grid (one SVD); lam = inf (no head: the prior's classes alone)
   is on the grid, so with little or uninformative data the head stays off by itself. With
   `head_se` (1, Breiman's one-standard-error rule) the head must beat no head by that many
   standard errors of the paired LOO squared-error differences, and the largest lam within as
   many of the best is taken: 384 dimensions on 80-175 rows find LOO gains of a few percent in
   noise, and such a head, fit near interpolation, shifted the sum of the forecasts for held-out
   BIG-bench prompts by up to 30% (the accumulated error the scheduler cares about).

The upper forecast is split-conformal: the point plus the `upper_percentile` of the job's
leave-one-out residuals (distribution-free, no assumption on the lengths' shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

LAMBDA_GRID = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)   # x the mean squared singular value
MIN_RIDGE_EXAMPLES = 12          # fewer: no head (the LOO error of so few is noise)


@dataclass
class OnlineFit:
    """What one refit learned; `predict` applies it to cached features."""

    scale: float = 1.0
    class_means: Optional[np.ndarray] = None      # recalibrated, one per prior class
    weights: Optional[np.ndarray] = None          # ridge on standardised embeddings; None: off
    center: Optional[np.ndarray] = None
    std: Optional[np.ndarray] = None
    lam: Optional[float] = None
    residual_quantiles: dict = field(default_factory=dict)   # percentile -> LOO residual
    examples: int = 0
    loo_rmse_prior: Optional[float] = None        # the recalibrated classes alone
    loo_rmse: Optional[float] = None              # with the head (when it is on)

    def predict(self, prior: np.ndarray, classes: np.ndarray,
                features: Optional[np.ndarray]) -> np.ndarray:
        """Point forecasts (tokens, unclipped) for requests with prior forecasts `prior`, prior
        classes `classes` (-1: no class) and embeddings `features` (rows; None: no head)."""
        prior = np.asarray(prior, dtype=np.float64)
        base = prior * self.scale
        if self.class_means is not None:
            cls = np.asarray(classes, dtype=np.int64)
            known = (cls >= 0) & (cls < len(self.class_means))
            base = np.where(known, self.class_means[np.clip(cls, 0, len(self.class_means) - 1)],
                            base)
        if self.weights is not None and features is not None and len(features):
            base = base + ((np.asarray(features, dtype=np.float64) - self.center) / self.std
                           ) @ self.weights
        return base

    def upper(self, point: np.ndarray, percentile: float) -> Optional[np.ndarray]:
        q = self.residual_quantiles.get(float(percentile))
        return None if q is None else np.asarray(point, dtype=np.float64) + max(q, 0.0)

    def to_json(self) -> dict:
        return {"examples": self.examples, "scale": round(self.scale, 4),
                "class_means": None if self.class_means is None
                else [round(float(m), 1) for m in self.class_means],
                "head": self.weights is not None, "lambda": self.lam,
                "loo_rmse_classes": _r(self.loo_rmse_prior), "loo_rmse": _r(self.loo_rmse)}


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(float(v), 2)


def global_scale(actual: np.ndarray, prior: np.ndarray, prior_weight: float,
                 horizons: Optional[np.ndarray] = None) -> float:
    """sum(actual) / sum(prior), shrunk to 1 by `prior_weight` pseudo-examples.

    With `horizons` (how far each request has been watched, in its own tokens: a finished one
    its length plus the tokens generated since; a decoding one what it has generated, its
    `actual` then being that same lower bound), both sides are truncated there, so requests not
    finished yet count for what is known of them (a censored moment match):
    sum(min(actual, h)) / sum(min(prior, h)). Learning from the finished alone would read the
    short replies, which end first, as the job's lengths."""
    if actual.size == 0:
        return 1.0
    mean_o = max(float(prior.mean()), 1.0)
    if horizons is not None:
        actual = np.minimum(actual, horizons)
        prior = truncated_mean(prior, horizons)
    return float((actual.sum() + prior_weight * mean_o) /
                 (max(float(prior.sum()), 0.0) + prior_weight * mean_o))


def truncated_mean(mean: np.ndarray, horizon: np.ndarray) -> np.ndarray:
    """E[min(L, h)] for a length L forecast at `mean`, read as exponentially distributed (the
    spread of reply lengths around a forecast is about its size): mean * (1 - exp(-h / mean)).
    min(mean, h) would overstate it (min is concave) and so understate the scale."""
    mean = np.maximum(np.asarray(mean, dtype=np.float64), 1e-6)
    return mean * -np.expm1(-np.asarray(horizon, dtype=np.float64) / mean)


def recalibrated_means(actual: np.ndarray, classes: np.ndarray, prior_means: Sequence[float],
                       scale: float, prior_weight: float) -> np.ndarray:
    """Each class's mean on the job, the prior's (rescaled) mean worth `prior_weight` examples."""
    prior_means = np.asarray(prior_means, dtype=np.float64)
    out = np.empty(len(prior_means))
    for k, m in enumerate(prior_means):
        members = actual[classes == k]
        out[k] = (members.sum() + prior_weight * scale * m) / (members.size + prior_weight)
    return out


def censored_means(known: np.ndarray, censored: np.ndarray, caps: np.ndarray,
                   classes: np.ndarray, prior_means: Sequence[float], scale: float,
                   prior_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Each class's mean length on the job from finished requests (`known` = their lengths) and
    decoding ones (`censored`, `known` = the tokens generated so far), lengths read as
    exponential, censored at their max_tokens `caps`, with the rescaled prior mean worth
    `prior_weight` finished requests (a conjugate Gamma prior on the rate). -> (the class means,
    every request's expected length under them: E[min(L, cap) | L > g] = g + m (1 - e^-(cap-g)/m)
    for a decoding one). The mean is the fixed point of labelling each decoding request so:
    without caps (tokens watched + tau s m_k) / (finished + tau) in closed form, with them the
    root below that bound, found by bisection (the EM iteration converges too slowly when most
    of a class is still decoding). A class with nothing finished and no prior weight keeps the
    prior's mean: nothing says where its replies end. Requests of no class (-1) are left out."""
    prior = np.asarray(prior_means, dtype=np.float64) * scale
    raw = np.asarray(classes, dtype=np.int64)
    in_class = (raw >= 0) & (raw < len(prior))
    room = np.maximum(caps - known, 0.0)
    means = prior.copy()
    for k in range(len(prior)):
        members = in_class & (raw == k)
        finished = float((members & ~censored).sum())
        if finished + prior_weight <= 0:
            continue
        watched = float(known[members].sum()) + prior_weight * prior[k]
        events = finished + prior_weight
        tails = room[members & censored]
        rows = float(members.sum()) + prior_weight

        def excess(m: float) -> float:            # > 0 below the fixed point, < 0 above it
            return watched + float((m * -np.expm1(-tails / m)).sum()) - m * rows

        lo, hi = 1e-6, max(watched / events, 1e-6)     # the uncapped fixed point bounds it
        if excess(hi) >= 0:
            means[k] = hi
            continue
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        means[k] = 0.5 * (lo + hi)
    m = np.maximum(means[np.clip(raw, 0, len(prior) - 1)], 1e-6)
    labels = np.where(censored & in_class, known + m * -np.expm1(-room / m), known)
    return means, labels


def ridge_loo(x: np.ndarray, r: np.ndarray, grid: Sequence[float] = LAMBDA_GRID,
              se: float = 1.0) -> tuple[Optional[float], Optional[np.ndarray], np.ndarray, float]:
    """Ridge of `r` on the (already standardised) rows `x` with lam picked by exact leave-one-out
    error. -> (lam or None when no lam beats predicting 0, weights or None, the LOO residuals of
    the choice, their RMSE). `se` > 0: the one-standard-error rule (module docstring): no head
    unless the best lam's mean LOO squared error is below no head's by `se` standard errors of
    the paired differences, then the largest lam within `se` of them of the best; 0: the lam of
    the least LOO error, on whenever it beats no head at all."""
    n = len(r)
    base = r.copy()                                  # w = 0: the residual itself
    best = (None, None, base, float(np.sqrt(np.mean(base ** 2))) if n else 0.0)
    if n < MIN_RIDGE_EXAMPLES or x.shape[1] == 0:
        return best
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    s2 = s ** 2
    scale = float(s2.mean()) if s2.size else 1.0
    ur = u.T @ r
    tried = []                                       # (lam, LOO residuals, mean diff, its SE)
    for factor in grid:
        lam = factor * scale
        shrink = s2 / (s2 + lam)
        fitted = u @ (shrink * ur)
        hat = (u ** 2) @ shrink
        loo = (r - fitted) / np.maximum(1.0 - hat, 1e-6)
        diff = loo ** 2 - base ** 2
        tried.append((lam, loo, float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(n))))
    lam, loo, gain, err = min(tried, key=lambda t: t[2])
    if gain + se * err >= 0 or gain >= 0:
        return best
    for lam_k, loo_k, gain_k, _ in reversed(tried):  # the grid ascends: the largest lam first
        if gain_k <= gain + se * err:
            lam, loo = lam_k, loo_k
            break
    w = vt.T @ ((s / (s2 + lam)) * ur)
    return lam, w, loo, float(np.sqrt(np.mean(loo ** 2)))


def fit_online(actual: Sequence[float], prior: Sequence[float], classes: Sequence[int],
               prior_means: Optional[Sequence[float]], features: Optional[np.ndarray],
               prior_weight: float = 8.0, percentiles: Sequence[float] = (),
               use_head: bool = True, horizons: Optional[Sequence[float]] = None,
               censored: Optional[Sequence[bool]] = None,
               caps: Optional[Sequence[float]] = None, impute: str = "job",
               tail_weight: float = 32.0, head_se: float = 1.0) -> OnlineFit:
    """One refit on the job's labelled examples (see the module docstring). `horizons` and
    `censored` (requests still decoding, `actual` = the g tokens they generated): the scale is
    the censored moment match of `global_scale`, and a censored request's label for the class
    means and the head is its expected length under the same exponential reading, capped at its
    max_tokens (`caps`): E[L | L > g] = g + its class's recalibrated mean (`impute="job"`, the
    class means of `censored_means` with the prior worth `tail_weight` finished requests) or
    g + scale * prior (`impute="prior"`, the class means then `recalibrated_means`)."""
    if impute not in ("job", "prior"):
        raise ValueError(f"impute must be 'job' or 'prior', not {impute!r}")
    y = np.asarray(actual, dtype=np.float64)
    o = np.asarray(prior, dtype=np.float64)
    cls = np.asarray(classes, dtype=np.int64)
    fit = OnlineFit(examples=int(y.size))
    if y.size == 0:
        return fit
    h = None if horizons is None else np.asarray(horizons, dtype=np.float64)
    fit.scale = global_scale(y, o, prior_weight, h)
    has_means = prior_means is not None and len(prior_means) > 0
    if censored is not None and np.any(censored):
        cens = np.asarray(censored, dtype=bool)
        cap = np.full(y.size, np.inf) if caps is None else np.asarray(caps, dtype=np.float64)
        if impute == "job" and has_means:
            fit.class_means, y = censored_means(y, cens, np.maximum(cap, y), cls, prior_means,
                                                fit.scale, tail_weight)
            has_means = False
        else:
            y = np.where(cens, np.minimum(y + fit.scale * o, np.maximum(cap, y)), y)
    if has_means:
        fit.class_means = recalibrated_means(y, cls, prior_means, fit.scale, prior_weight)
    base = fit.predict(o, cls, None)
    r = y - base
    fit.loo_rmse_prior = float(np.sqrt(np.mean(r ** 2)))
    loo = r
    if use_head and features is not None and len(features) == y.size:
        x = np.asarray(features, dtype=np.float64)
        center = x.mean(axis=0)
        std = x.std(axis=0) + 1e-6
        lam, w, loo_h, rmse = ridge_loo((x - center) / std, r, se=head_se)
        if w is not None:
            fit.weights, fit.center, fit.std, fit.lam = w, center, std, round(float(lam), 3)
            fit.loo_rmse, loo = rmse, loo_h
    for p in percentiles:
        fit.residual_quantiles[float(p)] = float(np.percentile(loo, p))
    return fit
