"""SiDP's executor: the pipeline executor, plus the weight-slot counters each replica's worker
reports with its results (summed over replicas for report.json's strategy_stats)."""
from __future__ import annotations

from batchinfer.engine.runtime.executor import PipelineExecutor


class SlotTotals:
    """The latest counters of every replica's worker (they are cumulative)."""

    def __init__(self, replicas: int):
        self.latest: list[dict] = [{} for _ in range(replicas)]

    def summary(self) -> dict:
        keys = ("fetches", "bytes", "hits", "waits", "wait_s")
        total = {k: sum(r.get(k, 0) for r in self.latest) for k in keys}
        reads = total["hits"] + total["waits"]
        return {"weight_fetches": total["fetches"], "weight_fetch_bytes": total["bytes"],
                "weight_slot_hit_ratio": round(total["hits"] / reads, 4) if reads else None,
                "weight_wait_s": round(total["wait_s"], 3)}


class SiDPExecutor(PipelineExecutor):
    def __init__(self, pool, layout, replica, block_manager, step_timeout_s, totals: SlotTotals):
        super().__init__(pool, layout, replica, block_manager, step_timeout_s)
        self.totals = totals

    def _take_result(self, mb_id: int) -> dict:
        message = super()._take_result(mb_id)
        if "weight_slots" in message:
            self.totals.latest[self.replica] = message["weight_slots"]
        return message

    def strategy_summary(self) -> dict:
        return self.totals.summary()
