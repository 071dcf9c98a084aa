"""The session's timeline as the job keeps it in memory for the plots: at most `max_points`
points, however long the job runs.

metrics.jsonl gets every sample (one per `report.metrics_interval_seconds`); the plots, redrawn
every `report.plot_refresh_seconds`, need no more points than a figure has pixels. Keeping every
sample cost about 1.3 KB a second (110 MB a day) and a redraw grew with the job's age. When the
points reach `max_points`, neighbours are merged pairwise and from then on each point covers
twice as many samples, so the points stay evenly spaced in time. A merged point keeps what each
plotted field means: sums of counts, time-weighted rates, step-weighted means, the extremes of
maxima and minima, and the later sample's end-of-interval readings.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

MAX_POINTS = 2048

_SUMMED = ("requests_done", "requests_failed", "steps")
_PER_STEP = ("batch_size_mean", "mb_prefill_mean", "mb_decode_mean")
_RATES = ("output_tokens_per_s", "prefill_tokens_per_s")


def merge_samples(a: dict, b: dict) -> dict:
    """One point for two consecutive samples (`a` first)."""
    merged = dict(b)          # end-of-interval readings (t, totals, kv_usage, queue lengths)
    dt = a.get("dt", 0.0) + b.get("dt", 0.0)
    merged["dt"] = round(dt, 3)
    for key in _RATES:
        if dt > 0:
            merged[key] = round((a.get(key, 0.0) * a.get("dt", 0.0)
                                 + b.get(key, 0.0) * b.get("dt", 0.0)) / dt, 2)
    steps_a, steps_b = a.get("steps", 0), b.get("steps", 0)
    for key in _SUMMED:
        merged[key] = a.get(key, 0) + b.get(key, 0)
    merged["busy_s"] = round(a.get("busy_s", 0.0) + b.get("busy_s", 0.0), 4)
    for key in _PER_STEP:
        parts = [(s[key], n) for s, n in ((a, steps_a), (b, steps_b)) if key in s and n]
        if parts:
            merged[key] = round(sum(v * n for v, n in parts) / sum(n for _, n in parts), 2)
    for key, pick in (("batch_size_max", max), ("kv_usage_max", max), ("mb_tokens_max", max),
                      ("mb_tokens_min", min)):
        values = [s[key] for s in (a, b) if s.get(key) is not None]
        if values:
            merged[key] = pick(values)
    for key in ("kv_predicted", "kv_store_usage"):
        if key not in b and key in a:
            merged[key] = a[key]
    for key in ("mode_steps", "phase_s"):
        if key in a or key in b:
            total = Counter(a.get(key) or {})
            total.update(b.get(key) or {})
            merged[key] = ({k: round(v, 4) for k, v in total.items()} if key == "phase_s"
                           else dict(total))
    if a.get("expert_tokens") is not None and b.get("expert_tokens") is not None:
        merged["expert_tokens"] = [x + y for x, y in zip(a["expert_tokens"], b["expert_tokens"])]
    elif a.get("expert_tokens") is not None:
        merged["expert_tokens"] = a["expert_tokens"]
    return merged


class BoundedTimeline:
    """Samples in, at most `max_points` evenly spaced points out (`points()`)."""

    def __init__(self, max_points: int = MAX_POINTS):
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, not {max_points}")
        self.max_points = max_points
        self.samples_per_point = 1
        self._points: list[dict] = []
        self._partial: Optional[dict] = None   # the newest point, still taking samples
        self._partial_samples = 0

    def add(self, sample: dict) -> None:
        self._partial = sample if self._partial is None else merge_samples(self._partial, sample)
        self._partial_samples += 1
        if self._partial_samples < self.samples_per_point:
            return
        self._points.append(self._partial)
        self._partial, self._partial_samples = None, 0
        if len(self._points) >= self.max_points:
            points = self._points
            self._points = [merge_samples(points[i], points[i + 1]) if i + 1 < len(points)
                            else points[i] for i in range(0, len(points), 2)]
            self.samples_per_point *= 2

    def points(self) -> list[dict]:
        """What the plots draw: the closed points and the newest one still filling."""
        return self._points + ([self._partial] if self._partial is not None else [])

    def __len__(self) -> int:
        return len(self._points) + (self._partial is not None)
