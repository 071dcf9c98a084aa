"""How even the micro-batches are: tokens per micro-batch over a session (arXiv:2504.14775 Figs. 1 and 4b).

Under pipeline parallelism every stage waits for the slowest micro-batch in flight, so uneven
token counts are pipeline bubbles. This keeps bounded statistics of the token count of each
micro-batch: a histogram (for percentiles), the coefficient of variation, and the mean change
between consecutive micro-batches of one replica (what a stage sees one after the other).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional


class MicroBatchTokens:
    def __init__(self) -> None:
        self.histogram: Counter = Counter()   # tokens -> micro-batches; counts and moments too
        self.prefill = 0
        self.decode = 0
        self.change = 0
        self.changes = 0
        self._last: dict[int, int] = {}      # replica -> tokens of its previous micro-batch

    def add(self, prefill_tokens: int, decode_tokens: int, replica: int = 0) -> None:
        tokens = prefill_tokens + decode_tokens
        self.histogram[tokens] += 1
        self.prefill += prefill_tokens
        self.decode += decode_tokens
        last = self._last.get(replica)
        if last is not None:
            self.change += abs(tokens - last)
            self.changes += 1
        self._last[replica] = tokens

    def _percentile(self, q: float, count: int) -> int:
        rank = max(1, math.ceil(q * count))
        seen = 0
        for tokens in sorted(self.histogram):
            seen += self.histogram[tokens]
            if seen >= rank:
                return tokens
        return max(self.histogram)

    def summary(self) -> Optional[dict]:
        count = sum(self.histogram.values())
        if not count:
            return None
        mean = sum(t * n for t, n in self.histogram.items()) / count
        std = math.sqrt(sum(n * (t - mean) ** 2 for t, n in self.histogram.items()) / count)
        change = self.change / self.changes if self.changes else 0.0
        return {
            "micro_batches": count,
            "mean": round(mean, 2), "std": round(std, 2),
            "cv": round(std / mean, 4) if mean else None,
            "p10": self._percentile(0.10, count), "p50": self._percentile(0.50, count),
            "p90": self._percentile(0.90, count), "max": max(self.histogram),
            "prefill_mean": round(self.prefill / count, 2),
            "decode_mean": round(self.decode / count, 2),
            "mean_change": round(change, 2),
            "mean_change_ratio": round(change / mean, 4) if mean else None,
        }


DEFINITION = ("tokens (prefill + decode) per micro-batch: cv = std / mean; mean_change = mean "
              "|difference| between a replica's consecutive micro-batches (arXiv:2504.14775 Fig. 4b: even "
              "micro-batches leave no pipeline bubbles)")
