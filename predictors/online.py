"""Learning from the running job (`predictor.online`, issue 43): every finished request is a
labelled example, and the forecasts of the requests still waiting are redone as they come in.

    online = OnlineLengthPredictor(base)            # base: the BERT predictor (or mean)
    forecasts = online.forecast(requests)           # caches each request's embedding + prior
    online.observe(request_id, output_tokens)       # a request finished
    if online.due():
        for request, forecast in online.update(progress):   # refit, then re-forecast the rest
            ...                                      # the job hands them to the scheduler

The encoder runs once per request, when it is first forecast: its pooled state and class
probabilities are cached until the request finishes, so a refit is numpy on a few hundred rows
(online_fit.py: global scale, per-class means, a ridge head with leave-one-out lam, each shrunk
to the prior) and re-forecasting is one matrix product. A refit runs between engine steps every
`refit_every` finished requests, but never sooner than 1 / `time_budget` (1%) times the last
one's cost after it, at most `max_examples` (the newest) enter it, numpy's BLAS runs on one
thread for it, and its cost is measured (`stats()`).

The first requests to finish are the short ones (a job admits many, the short replies end
first), so learning from them alone would pull every forecast down. With `censored` the requests
still decoding count too (`progress`: request id -> tokens generated): the global scale compares
what is known of every request with what the prior said, both cut at how far the request has
been watched (a finished one: its length plus the tokens generated since, on a token clock the
progress advances), and a decoding request that generated g tokens is labelled with its expected
length under the same reading, g + its class's mean as the job's own replies put it
(`impute="job"`, online_fit.censored_means: the prior's mean worth `tail_weight` finished
requests) or as the rescaled prior puts it (`impute="prior"`, the earlier rule), capped at its
max_tokens.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .base import Forecast, LengthPredictor, LengthQuery, cap, class_forecasts
from .classes import means_past_cap
from .online_fit import OnlineFit, fit_online

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Any
    prior: float                  # the base predictor's point (uncapped class mean)
    cls: int                      # the base predictor's class, -1 without classes
    feature: Optional[np.ndarray]
    confidence: Optional[float]
    max_tokens: Optional[int]
    first: int                    # the forecast it was admitted with
    current: int                  # the forecast the scheduler sees now
    current_upper: Optional[int] = None   # and its upper forecast


@dataclass
class _Done:
    prior: float
    cls: int
    feature: Optional[np.ndarray]
    actual: int
    clock: float = 0.0            # the token clock when it finished


class _ErrorWindows:
    """The forecast error timeline (`OnlineLengthPredictor.timeline`) kept as it grows: per
    window of `size` finished requests only the sums the error needs, so a finish costs O(1)
    and the memory is one row per window, not one per request."""

    def __init__(self, size: int):
        self.size = size
        self.finished = 0
        self._closed: list[dict] = []
        self._open = [0.0, 0.0, 0.0]      # sums over the open window: first, last, actual
        self._open_count = 0
        self._open_t: Optional[float] = None

    def add(self, first: int, last: int, actual: int, t: Optional[float]) -> None:
        sums = self._open
        sums[0] += first
        sums[1] += last
        sums[2] += actual
        self._open_count += 1
        self._open_t = t
        self.finished += 1
        if self._open_count == self.size:
            self._closed.append(self._row())
            self._open, self._open_count = [0.0, 0.0, 0.0], 0

    def rows(self) -> list[dict]:
        return self._closed + ([self._row()] if self._open_count else [])

    def _row(self) -> dict:
        """accumulated_error (classes.py) over one group: |sum forecast - sum actual| /
        sum actual (the sums of integers are exact in any order)."""
        first, last, actual = self._open
        t = self._open_t
        return {"finished": self.finished, "t": None if t is None else round(t, 2),
                "error_online": round(abs(last - actual) / max(actual, 1.0), 4),
                "error_prior": round(abs(first - actual) / max(actual, 1.0), 4)}


def request_key(request: Any) -> Optional[str]:
    key = getattr(request, "request_id", None)
    if key is None:
        key = getattr(request, "key", None)
    return None if key is None else str(key)


class OnlineLengthPredictor(LengthPredictor):
    """Wraps a predictor; learns from the job it forecasts for (see the module docstring)."""

    def __init__(self, base: LengthPredictor, refit_every: int = 16, min_examples: int = 8,
                 prior_weight: float = 8.0, head: bool = True, censored: bool = True,
                 max_examples: int = 1024, upper_percentile: Optional[float] = None,
                 time_budget: Optional[float] = 0.01, impute: str = "job",
                 tail_weight: float = 32.0, head_se: float = 1.0):
        super().__init__(base.oracle_field)
        self.base = base
        self.name = base.name
        self.refit_every = max(int(refit_every), 1)
        self.min_examples = max(int(min_examples), 1)
        self.prior_weight = float(prior_weight)
        self.head = head
        self.censored = censored
        if impute not in ("job", "prior"):
            raise ValueError(f"impute must be 'job' or 'prior', not {impute!r}")
        self.impute = impute
        self.tail_weight = float(tail_weight)
        self.head_se = max(float(head_se), 0.0)
        self.max_examples = max(int(max_examples), 1)
        self.time_budget = time_budget
        self._last_refit_end: Optional[float] = None
        self._last_refit_cost = 0.0
        if upper_percentile is not None:
            self.upper_percentile = float(upper_percentile)
        self._classes = _classes_of(base)
        self._widest_cap: Optional[int] = 0      # the largest max_tokens forecast (None: unbounded)
        self._pending: dict[str, _Pending] = {}
        self._done: deque[_Done] = deque(maxlen=self.max_examples)   # the newest finished
        self._since_fit = 0
        self._clock = 0.0                          # tokens a decoding request has generated
        self._last_progress: dict = {}             # since the job began (advanced by update)
        self.fit: Optional[OnlineFit] = None
        self.refits = 0
        self.refit_seconds = 0.0
        self.refit_max_s = 0.0
        self.reforecasts = 0
        self._error_windows = _ErrorWindows(max(self.refit_every * 4, 32))

    # --- forecasting ------------------------------------------------------------------------------
    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        return [f.point for f in self.forecast_queries(queries)]

    def forecast(self, requests: Sequence[Any]) -> list[Forecast]:
        """Forecasts, and each request's prior and embedding kept for re-forecasting."""
        return self._timed(lambda queries: self._forecast_pending(requests, queries), requests)

    def _forecast_pending(self, requests: Sequence[Any],
                          queries: Sequence[LengthQuery]) -> list[Forecast]:
        priors, classes, features, base = self._prior(queries)
        out = self._apply(priors, classes, features, base, queries)
        for r, q, p, c, f, b, fc in zip(requests, queries, priors, classes,
                                        features if features is not None else [None] * len(out),
                                        base, out):
            key = request_key(r)
            if key is not None:
                self._pending[key] = _Pending(r, float(p), int(c), f, b.confidence, q.max_tokens,
                                              fc.point, fc.point, fc.upper)
        return out

    def forecast_queries(self, queries: Sequence[LengthQuery]) -> list[Forecast]:
        priors, classes, features, base = self._prior(queries)
        return self._apply(priors, classes, features, base, queries)

    def _prior(self, queries: Sequence[LengthQuery]):
        """(prior points, classes, embeddings or None, the base's forecasts), one encoder pass."""
        if self._classes is not None and hasattr(self.base, "features"):
            feats, probs = self.base.features([q.text for q in queries])
            means, edges, tail = self._classes
            base = class_forecasts(probs, means, edges, queries, self.upper_percentile, tail)
            cls = probs.argmax(axis=1)
            priors = np.array([means_past_cap(means, tail, q.max_tokens)[c]
                               for q, c in zip(queries, cls)], dtype=np.float64)
            for q in queries:
                self._widest_cap = (None if q.max_tokens is None or self._widest_cap is None
                                    else max(self._widest_cap, q.max_tokens))
            return priors, cls, (feats if self.head else None), base
        base = self.base.forecast_queries(queries)
        return (np.array([f.point for f in base], dtype=np.float64),
                np.full(len(base), -1), None, base)

    def _apply(self, priors, classes, features, base: list[Forecast],
               queries: Sequence[LengthQuery]) -> list[Forecast]:
        if self.fit is None:
            return list(base)
        points = self.fit.predict(priors, classes, features)
        uppers = self.fit.upper(points, self.upper_percentile)
        out = []
        for i, (q, b) in enumerate(zip(queries, base)):
            point = cap(max(points[i], 1.0), q.max_tokens)
            upper = b.upper if uppers is None else max(cap(uppers[i], q.max_tokens), point)
            out.append(Forecast(point, upper, b.confidence))
        return out

    # --- learning ---------------------------------------------------------------------------------
    def observe(self, key: Any, output_tokens: int, now: Optional[float] = None) -> bool:
        """A request finished with `output_tokens`: a labelled example (False: never forecast
        here, e.g. a duplicate that followed its leader)."""
        entry = self._pending.pop(str(key), None)
        if entry is None:
            return False
        actual = int(output_tokens)
        self._done.append(_Done(entry.prior, entry.cls, entry.feature, actual, self._clock))
        self._since_fit += 1
        self._error_windows.add(entry.first, entry.current, actual, now)
        return True

    def forget(self, key: Any) -> None:
        """A request that ended without a length to learn from (aborted, failed)."""
        self._pending.pop(str(key), None)

    def current(self, key: Any) -> Optional[int]:
        """The forecast a pending request has now (what the scheduler reads)."""
        entry = self._pending.get(str(key))
        return None if entry is None else entry.current

    def pending_keys(self) -> set[str]:
        return set(self._pending)

    def due(self) -> bool:
        """`refit_every` finished since the last refit, and (with `time_budget`) the time since
        it at least 1 / time_budget times what it took: refits never take more than that share
        of the job, however fast requests finish."""
        # min_examples counts the finished requests: _done keeps only the newest max_examples
        if self._since_fit < self.refit_every or self._error_windows.finished < self.min_examples:
            return False
        if self.time_budget and self._last_refit_end is not None:
            waited = time.perf_counter() - self._last_refit_end
            return waited * self.time_budget >= self._last_refit_cost
        return True

    def update(self, progress: Optional[dict] = None) -> list[tuple[Any, Forecast]]:
        """Refits on the finished requests (and, with `censored`, the decoding ones in
        `progress`), then re-forecasts every request still pending: (request, new forecast) for
        those whose forecast changed. Never raises: a refit that fails keeps the last one."""
        t = time.perf_counter()
        try:
            with _one_blas_thread():
                self._advance_clock(progress or {})
                self.fit = self._refit(progress or {})
                changed = self._reforecast(progress or {})
        except Exception as exc:  # noqa: BLE001 - an optimisation never fails the job
            log.warning("online length predictor: refit failed (%s: %s); keeping the last one",
                        type(exc).__name__, exc)
            changed = []
        self._since_fit = 0
        self._last_refit_end = time.perf_counter()
        spent = self._last_refit_end - t
        self._last_refit_cost = spent
        self.refits += 1
        self.refit_seconds += spent
        self.refit_max_s = max(self.refit_max_s, spent)
        self.seconds += spent
        return changed

    def _advance_clock(self, progress: dict) -> None:
        """The token clock: how many tokens a request decoding all along would have generated,
        the median progress, since the last update, of the requests decoding at both."""
        steps = [progress[k] - self._last_progress[k] for k in progress
                 if k in self._last_progress and progress[k] >= self._last_progress[k]]
        if steps:
            self._clock += float(np.median(steps))
        self._last_progress = dict(progress)

    def _refit(self, progress: dict) -> OnlineFit:
        # (prior, class, feature, label, horizon, censored, max_tokens)
        rows = [(d.prior, d.cls, d.feature, float(d.actual),
                 d.actual + self._clock - d.clock, False, np.inf) for d in self._done]
        if self.censored:
            for key, generated in progress.items():
                entry = self._pending.get(str(key))
                if entry is not None and generated > 0:
                    rows.append((entry.prior, entry.cls, entry.feature, float(generated),
                                 float(generated), True,
                                 np.inf if entry.max_tokens is None else entry.max_tokens))
        prior = np.array([r[0] for r in rows])
        cls = np.array([r[1] for r in rows])
        feats = None
        if self.head and rows and all(r[2] is not None for r in rows):
            feats = np.stack([r[2] for r in rows])
        # the classes' prior means for the job's largest max_tokens (exact for a job of one cap)
        means = (means_past_cap(self._classes[0], self._classes[2], self._widest_cap)
                 if self._classes is not None else None)
        censored = self.censored and any(r[5] for r in rows)
        return fit_online([r[3] for r in rows], prior, cls, means, feats, self.prior_weight,
                          percentiles=(self.upper_percentile,), use_head=self.head,
                          horizons=[r[4] for r in rows] if censored else None,
                          censored=[r[5] for r in rows] if censored else None,
                          caps=[r[6] for r in rows], impute=self.impute,
                          tail_weight=self.tail_weight, head_se=self.head_se)

    def _reforecast(self, progress: dict) -> list[tuple[Any, Forecast]]:
        """New forecasts for the pending requests; one decoding already (`progress`: its tokens
        so far) is never forecast to end before the token it generates next."""
        if not self._pending or self.fit is None:
            return []
        keys = list(self._pending)
        entries = [self._pending[k] for k in keys]
        priors = np.array([e.prior for e in entries])
        cls = np.array([e.cls for e in entries])
        feats = None
        if self.head and all(e.feature is not None for e in entries):
            feats = np.stack([e.feature for e in entries])
        points = self.fit.predict(priors, cls, feats)
        uppers = self.fit.upper(points, self.upper_percentile)
        changed = []
        for i, (key, e) in enumerate(zip(keys, entries)):
            point = cap(max(points[i], progress.get(key, 0) + 1, 1.0), e.max_tokens)
            upper = point if uppers is None else max(cap(uppers[i], e.max_tokens), point)
            if (point, upper) != (e.current, e.current_upper):
                e.current, e.current_upper = point, upper
                changed.append((e.request, Forecast(point, upper, e.confidence)))
        self.reforecasts += len(changed)
        return changed

    # --- reporting --------------------------------------------------------------------------------
    def timeline(self) -> list[dict]:
        """Forecast error over the job: per window of finished requests (in finishing order,
        max(4 refit_every, 32) a window, the last one partial), |sum forecast - sum actual| /
        sum actual for the forecast each had when it finished (online) and when it was admitted
        (the prior)."""
        return self._error_windows.rows()

    def stats(self) -> dict:
        return {**super().stats(), "online": {
            "refits": self.refits, "refit_seconds": round(self.refit_seconds, 4),
            "refit_max_ms": round(1e3 * self.refit_max_s, 2),
            "reforecasts": self.reforecasts, "finished": self._error_windows.finished,
            "examples": len(self._done),
            "fit": None if self.fit is None else self.fit.to_json(),
            "timeline": self.timeline()}}

    def describe(self) -> dict:
        return {**self.base.describe(), "online": True}


def _one_blas_thread():
    """numpy's BLAS on one thread for a refit: its small SVD takes ~30 ms so, but seconds with
    a BLAS thread per core spinning against the engine's threads for the same cores."""
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=1, user_api="blas")
    except Exception:  # noqa: BLE001 - without threadpoolctl the refit is only slower
        return contextlib.nullcontext()


def _classes_of(base: LengthPredictor
                ) -> Optional[tuple[list[float], list[float], Optional[dict]]]:
    """(class means, edges, classes.cut_tail) of a class predictor; None for another."""
    means = getattr(base, "means", None)
    edges = getattr(base, "edges", None)
    if means is None or edges is None:
        return None
    return [float(m) for m in means], [float(e) for e in edges], getattr(base, "cut_tail", None)
