"""SiDP's executor: the pipeline executor of one replica, whose plans go out through the job
orchestrator (WaS: at once; CaS: together with the other replicas' as a round), plus the
counters the workers report (weight slots, compute service) summed for report.json."""
from __future__ import annotations

from batchinfer.engine.runtime.executor import PipelineExecutor
from batchinfer.engine.step_plan import StepPlan

from .mode_switch import CAS, WAS
from .orchestrator import Orchestrator


class SiDPExecutor(PipelineExecutor):
    def __init__(self, pool, layout, replica, block_manager, step_timeout_s,
                 orchestrator: Orchestrator):
        super().__init__(pool, layout, replica, block_manager, step_timeout_s)
        self.orchestrator = orchestrator
        orchestrator.executors[replica] = self
        self.num_sent = 0           # plans at the worker whose results are not collected yet
        self.last_mode: str = WAS   # the mode the last collected micro-batch ran in
        self._cas_mbs: set[int] = set()

    def _dispatch(self, plan: StepPlan) -> None:
        self.orchestrator.submit(self.replica, plan)

    def mark_sent(self, mb_id: int, cas: bool) -> None:
        self.num_sent += 1
        if cas:
            self._cas_mbs.add(mb_id)

    def result_arrived(self) -> bool:
        return bool(self.pool.results[self.replica])

    def flush_submissions(self) -> None:
        self.orchestrator.flush()

    def wait(self) -> None:
        """A plan held for a round that waits on nobody (say, while the engine drains) goes now."""
        if self.orchestrator.is_held(self.replica):
            if not self.orchestrator.waiting_on_others(self.replica):
                self.orchestrator.flush(force=True)
                return
        super().wait()

    def _take_result(self, mb_id: int) -> dict:
        message = super()._take_result(mb_id)
        self.num_sent -= 1
        self.last_mode = CAS if mb_id in self._cas_mbs else WAS
        self._cas_mbs.discard(mb_id)
        return message

    def step_stats(self) -> dict:
        return {"mode": self.last_mode}     # WaS or CaS: how the step ran (paper Fig. 15)

    def strategy_summary(self) -> dict:
        if not self.pool.closed:
            self.pool.poll()          # counters a dummy round sent after the last result
        stats = [self.pool.worker_stats.get(r, {}) for r in range(self.layout.world_size)]
        slots = _sums([s.get("weight_slots", {}) for s in stats])
        service = _sums([s.get("compute_service", {}) for s in stats])
        reads = slots.get("hits", 0) + slots.get("waits", 0)
        out = {"weight_fetches": slots.get("fetches", 0),
               "weight_fetch_bytes": slots.get("bytes", 0),
               "weight_slot_hit_ratio": round(slots["hits"] / reads, 4) if reads else None,
               "weight_wait_s": round(slots.get("wait_s", 0.0), 3),
               **self.orchestrator.summary()}
        if service:
            out["compute_service"] = service
            out["compute_service_per_replica"] = [s.get("compute_service", {}) for s in stats]
        return out


def _sums(dicts: list[dict]) -> dict:
    total: dict = {}
    for counters in dicts:
        for key, value in counters.items():
            total[key] = total.get(key, 0) + value
    return total
