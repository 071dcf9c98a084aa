"""SiPipe's controller side: the pipeline executor with sampling in CPU sampler processes.

Micro-batch n goes to sampler n mod p (p = the pipeline depth, so micro-batches n and n + p, which
carry the same sequences, meet the same column buffers). Before each plan goes out, that sampler's
ColumnAssigner fixes each sampled row's column; the plan carries the columns (the last stage
writes the logits in that order) and the sampler gets the moves and joins. Samplers finish out of
order; results are applied in micro-batch order, as the engine expects.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from batchinfer.engine.runtime.executor import PipelineExecutor
from batchinfer.engine.runtime.pool import WorkerError
from batchinfer.engine.scheduler import MicroBatch
from batchinfer.engine.step_plan import StepPlan, plan_batch

from .columns import ColumnAssigner, ColumnJoin


@dataclass
class ColumnPlan(StepPlan):
    """A StepPlan plus where its sampled rows go: the sampler and each row's column there."""

    sampler: int = 0
    sample_columns: list[int] = field(default_factory=list)


class SiPipeExecutor(PipelineExecutor):
    def __init__(self, pool, layout, replica: int, block_manager, step_timeout_s: float,
                 sampler_ranks: list[int], capacity: int, seed: int):
        super().__init__(pool, layout, replica, block_manager, step_timeout_s)
        self.sampler_ranks = sampler_ranks
        self.assigners = [ColumnAssigner(capacity) for _ in sampler_ranks]
        self._rng = random.Random(seed)
        self._seeds: dict[str, int] = {}
        self._sampled = 0                 # micro-batches sampled, and their CPU sampling time
        self._sample_s = 0.0

    def _plan(self, batch: MicroBatch, mb_id: int) -> ColumnPlan:
        """The plan with each sampled row's column; the sampler gets its moves and joins."""
        plan = plan_batch(batch, self.block_manager, mb_id)
        sampler = mb_id % len(self.sampler_ranks)
        seqs = {batch.items[i].seq.request_id: batch.items[i].seq for i in plan.sample_items}
        columns, update = self.assigners[sampler].assign(
            plan.sample_request_ids, plan.sample_output_lens,
            lambda rid, col: self._join(seqs[rid], col))
        self.pool.send(self.sampler_ranks[sampler], ("step", mb_id, update))
        return ColumnPlan(**vars(plan), sampler=sampler, sample_columns=columns)

    def _join(self, seq, column: int) -> ColumnJoin:
        sampling = seq.request.sampling
        seed = sampling.seed
        if seed is None:
            seed = self._seeds.setdefault(seq.request_id, self._rng.getrandbits(63))
        return ColumnJoin(column, seq.request_id, list(seq.request.prompt_token_ids),
                          list(seq.output_token_ids), sampling, seed)

    def _result_of(self, mb_id: int) -> Optional[dict]:
        for message in self.pool.results[self.replica]:
            if message["mb_id"] == mb_id:
                return message
        return None

    def ready(self) -> bool:
        return bool(self._in_flight) and self._result_of(self._in_flight[0][0]) is not None

    def _take_result(self, mb_id: int) -> dict:
        """Samplers finish out of order: the result of `mb_id`, wherever it is in the queue."""
        message = self._result_of(mb_id)
        if message is None:
            raise WorkerError(f"replica {self.replica}: collect before micro-batch {mb_id}'s "
                              "tokens arrived")
        self.pool.results[self.replica].remove(message)
        self._sampled += 1
        self._sample_s += message["sample_s"]
        return message

    @staticmethod
    def _sampled_rows(plan: ColumnPlan, message: dict):
        """The sampler answers in column order."""
        return ((index, message["tokens"][col], message["logprobs"][col])
                for index, col in zip(plan.sample_items, plan.sample_columns))

    def release(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)

    def strategy_summary(self) -> dict:
        """For report.json's engine.strategy_stats (Engine.stats collects it)."""
        return {"cpu_sampled_micro_batches": self._sampled,
                "cpu_sampling_ms_per_micro_batch":
                    round(self._sample_s / self._sampled * 1e3, 3) if self._sampled else None}
