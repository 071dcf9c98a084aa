"""Pipeline timeline: per-rank busy time and bubble ratio (the report draws it: runner/report/plots.py).

Workers record wall-clock intervals ("forward", "recv" wait, "send") per micro-batch. A rank's
bubble ratio is the share of its replica's active window (first forward start to last forward
end, over all the replica's ranks) in which it was not computing.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional


class PipelineStats:
    """Running totals per rank, so a report never rescans the whole event history."""

    def __init__(self, rank_meta: dict[int, dict]):
        self.rank_meta = rank_meta          # rank -> {replica, stage, tp_rank}
        self.busy = defaultdict(float)
        self.recv_wait = defaultdict(float)
        self.send = defaultdict(float)
        self.micro_batches = defaultdict(int)
        self.reshard = defaultdict(float)           # time spent switching layouts (re-sharding)
        self.window: dict[int, list[float]] = {}   # replica -> [first start, last end]

    def add(self, events: Iterable[dict]) -> None:
        for e in events:
            rank, dur = e["rank"], e["end"] - e["start"]
            if e["kind"] == "forward":
                self.busy[rank] += dur
                self.micro_batches[rank] += 1
                span = self.window.setdefault(e["replica"], [e["start"], e["end"]])
                span[0], span[1] = min(span[0], e["start"]), max(span[1], e["end"])
            elif e["kind"] == "recv":
                self.recv_wait[rank] += dur
            elif e["kind"] == "send":
                self.send[rank] += dur
            elif e["kind"] == "reshard":
                self.reshard[rank] += dur

    def reshard_seconds(self) -> dict[int, float]:
        return dict(sorted(self.reshard.items()))

    def summary(self) -> Optional[dict]:
        if not self.busy:
            return None
        ranks = []
        for rank in sorted(self.rank_meta):
            meta = self.rank_meta[rank]
            first, last = self.window.get(meta["replica"], (0.0, 0.0))
            span = last - first
            busy = self.busy.get(rank, 0.0)
            ranks.append({"rank": rank, **meta, "micro_batches": self.micro_batches.get(rank, 0),
                          "busy_s": round(busy, 3), "window_s": round(span, 3),
                          "recv_wait_s": round(self.recv_wait.get(rank, 0.0), 3),
                          "send_s": round(self.send.get(rank, 0.0), 3),
                          "bubble_ratio": round(1.0 - busy / span, 4) if span > 0 else None})
        stages: dict[int, list[float]] = defaultdict(list)
        for r in ranks:
            if r["bubble_ratio"] is not None:
                stages[r["stage"]].append(r["bubble_ratio"])
        return {"ranks": ranks,
                "bubble_ratio_by_stage": {str(s): round(sum(v) / len(v), 4)
                                          for s, v in sorted(stages.items())}}
