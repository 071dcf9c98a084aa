"""SiPipe's controller side: the pipeline executor with sampling in a pool of CPU sampler processes.

Before each plan goes out, the pool's layout (sampler_pool.py) says which samplers take the
micro-batch and from which state replica, and that residue's ShareAssigner fixes each sampled
row's sampler and column; the plan carries the columns (the last stage writes the logits in that
order into slot mb_id mod p) and each sampler gets its SamplerStep (moves, joins, where its
columns are). Every sampler of a micro-batch answers with its share's tokens (the paper's BIC-O
subslots); the micro-batch is done when all have, and samplers finish out of order, so results are
applied in micro-batch order, as the engine expects.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from batchinfer.engine.runtime.executor import PipelineExecutor
from batchinfer.engine.runtime.pool import WorkerError
from batchinfer.engine.scheduler import MicroBatch
from batchinfer.engine.step_plan import StepPlan, plan_batch

from .columns import ColumnJoin
from .sampler_pool import PoolLayout, SamplerStep, ShareAssigner


@dataclass
class ColumnPlan(StepPlan):
    """A StepPlan plus each sampled row's column in the micro-batch's logits slot."""

    sample_columns: list[int] = field(default_factory=list)


class SiPipeExecutor(PipelineExecutor):
    def __init__(self, pool, layout, replica: int, block_manager, step_timeout_s: float,
                 sampler_ranks: list[int], sampler_pool: PoolLayout, seed: int):
        super().__init__(pool, layout, replica, block_manager, step_timeout_s)
        self.sampler_ranks = sampler_ranks
        self.sampler_pool = sampler_pool
        self.assigners = [ShareAssigner(len(sampler_pool.shares_of(residue)),
                                        sampler_pool.capacity)
                          for residue in range(sampler_pool.depth)]
        self._rng = random.Random(seed)
        self._seeds: dict[str, int] = {}
        self._sampled = 0                 # micro-batches sampled, and the pool's sampling time
        self._sample_s = 0.0

    def _plan(self, batch: MicroBatch, mb_id: int) -> ColumnPlan:
        """The plan with each sampled row's column; the micro-batch's samplers get their steps."""
        plan = plan_batch(batch, self.block_manager, mb_id)
        seqs = {batch.items[i].seq.request_id: batch.items[i].seq for i in plan.sample_items}
        assigner = self.assigners[mb_id % self.sampler_pool.depth]
        columns, updates = assigner.assign(plan.sample_request_ids, plan.sample_output_lens,
                                           lambda rid, col: self._join(seqs[rid], col))
        offset = 0
        for (sampler, replica), update in zip(self.sampler_pool.shares_of(mb_id), updates):
            self.pool.send(self.sampler_ranks[sampler], ("step", SamplerStep(
                mb_id, replica, update, offset, len(columns))))
            offset += update.width
        return ColumnPlan(**vars(plan), sample_columns=columns)

    def _join(self, seq, column: int) -> ColumnJoin:
        sampling = seq.request.sampling
        seed = sampling.seed
        if seed is None:
            seed = self._seeds.setdefault(seq.request_id, self._rng.getrandbits(63))
        return ColumnJoin(column, seq.request_id, list(seq.request.prompt_token_ids),
                          list(seq.output_token_ids), sampling, seed,
                          seq.request.bad_words_token_ids)

    def _shares_of(self, mb_id: int) -> list[dict]:
        return [m for m in self.pool.results[self.replica] if m["mb_id"] == mb_id]

    def ready(self) -> bool:
        if not self._in_flight:
            return False
        mb_id = self._in_flight[0][0]
        return len(self._shares_of(mb_id)) == len(self.sampler_pool.shares_of(mb_id))

    def _take_result(self, mb_id: int) -> dict:
        """Every share of `mb_id`, wherever they are in the queue, as one result in column order."""
        shares = self._shares_of(mb_id)
        if len(shares) != len(self.sampler_pool.shares_of(mb_id)):
            raise WorkerError(f"replica {self.replica}: collect before every sampler of "
                              f"micro-batch {mb_id} answered ({len(shares)} of "
                              f"{len(self.sampler_pool.shares_of(mb_id))})")
        tokens, logprobs = [], []
        for message in sorted(shares, key=lambda m: m["offset"]):
            self.pool.results[self.replica].remove(message)
            tokens += message["tokens"]
            logprobs += message["logprobs"]
        sample_s = max(m["sample_s"] for m in shares)    # the pool's slowest share
        self._sampled += 1
        self._sample_s += sample_s
        return {"mb_id": mb_id, "tokens": tokens, "logprobs": logprobs, "sample_s": sample_s,
                "forward_s": max(m["forward_s"] for m in shares)}

    @staticmethod
    def _sampled_rows(plan: ColumnPlan, message: dict):
        """The samplers answer in column order."""
        return ((index, message["tokens"][col], message["logprobs"][col])
                for index, col in zip(plan.sample_items, plan.sample_columns))

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._seeds.pop(request_id, None)

    def strategy_summary(self) -> dict:
        """For report.json's engine.strategy_stats (Engine.stats collects it)."""
        return {"cpu_sampled_micro_batches": self._sampled,
                "cpu_sampling_ms_per_micro_batch":
                    round(self._sample_s / self._sampled * 1e3, 3) if self._sampled else None,
                "sampler_columns_handed_over": sum(a.handed_over for a in self.assigners)}
