"""The multi-process Executor: one replica's tp x pp worker ranks, up to `pp` micro-batches in flight.

`submit` turns the micro-batch into a StepPlan and sends it to every rank of the replica (each
needs the token counts and block tables; only the first stage uses the token ids); the tables go
as changes to what the ranks already hold (plan_deltas.py). The sampling
rank sees each request's prompt and parameters once (`new_requests`) and keeps its own copy of
the tokens it sampled, so a plan carries no per-request history. Results come back in pipeline
(FIFO) order.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Optional

from ..executor import Executor, StepResult
from ..kv_cache import BlockManager
from ..request import Request
from ..scheduler import MicroBatch
from ..step_plan import StepPlan, plan_batch
from .layout import ParallelLayout
from .plan_deltas import TableEncoder
from .pool import WorkerError, WorkerPool


class PipelineExecutor(Executor):
    def __init__(self, pool: WorkerPool, layout: ParallelLayout, replica: int,
                 block_manager: BlockManager, step_timeout_s: float):
        self.pool, self.layout, self.replica = pool, layout, replica
        self.block_manager = block_manager
        self.step_timeout_s = step_timeout_s
        self.ranks = layout.replica_ranks(replica)
        self._in_flight: deque[tuple[int, MicroBatch, StepPlan]] = deque()
        self._known: set[str] = set()        # requests the sampling rank already has
        self._released: list[str] = []
        self._next_mb = 0
        # parallel.sequence_cache: the ranks keep each sequence's tables; plans carry changes
        self.tables = TableEncoder() if getattr(pool, "plan_deltas", False) else None

    @property
    def max_in_flight(self) -> int:
        """The pipeline's depth: one micro-batch per stage."""
        return self.layout.pp

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, batch: MicroBatch) -> None:
        mb_id = self._next_mb
        self._next_mb += 1
        plan = self._plan(batch, mb_id)
        self._in_flight.append((mb_id, batch, plan))
        self._dispatch(plan if self.tables is None else
                       self.tables.encode(plan, [item.seq.request_id for item in batch.items]))

    def _dispatch(self, plan: StepPlan) -> None:
        for rank in self.ranks:
            self.pool.send(rank, ("plan", plan))

    def _plan(self, batch: MicroBatch, mb_id: int) -> StepPlan:
        """The plan every rank gets; the sampling rank learns each request once."""
        plan = plan_batch(batch, self.block_manager, mb_id)
        for index, rid in zip(plan.sample_items, plan.sample_request_ids):
            if rid not in self._known:
                self._known.add(rid)
                req = batch.items[index].seq.request
                plan.new_requests.append(Request(rid, req.prompt_token_ids, req.sampling,
                                                 bad_words_token_ids=req.bad_words_token_ids))
        plan.released, self._released = self._released, []
        return plan

    def ready(self) -> bool:
        return bool(self.pool.results[self.replica])

    def wait(self) -> None:
        self.pool.pump(self.step_timeout_s)

    def collect(self) -> tuple[MicroBatch, StepResult]:
        mb_id, batch, plan = self._in_flight.popleft()
        message = self._take_result(mb_id)
        tokens: list[Optional[int]] = [None] * len(batch.items)
        logprobs: list[Optional[dict]] = [None] * len(batch.items)
        for index, token, logprob in self._sampled_rows(plan, message):
            tokens[index], logprobs[index] = token, logprob
        prompt_logprobs = message.get("prompt_logprobs")
        if prompt_logprobs is None and plan.prompt_scores:
            prompt_logprobs = self._prompt_scores_apart(mb_id)
        return batch, StepResult(tokens, logprobs, forward_s=message["forward_s"],
                                 sample_s=message["sample_s"],
                                 expert_load=self._expert_load(mb_id, message),
                                 prompt_logprobs=prompt_logprobs)

    def _prompt_scores_apart(self, mb_id: int) -> dict:
        """The micro-batch's scored prompt positions, which a last stage whose result other
        processes send (a worker extension's logits_out) sent on their own, ahead of them."""
        apart = self.pool.prompt_scores[self.replica]
        while mb_id not in apart:
            self.pool.pump(self.step_timeout_s)
        return apart.pop(mb_id)

    def _take_result(self, mb_id: int) -> dict:
        """The sampling rank answers in pipeline order."""
        message = self.pool.results[self.replica].popleft()
        if message["mb_id"] != mb_id:
            raise WorkerError(f"replica {self.replica}: result for micro-batch {message['mb_id']} "
                              f"arrived while {mb_id} was expected (pipeline order broken)")
        return message

    def _expert_load(self, mb_id: int, message: dict) -> Optional[dict[int, list[int]]]:
        """A mixture of experts: the micro-batch's tokens per expert, by decoder layer: the
        earlier stages' (each sent them before its hidden states) and the last stage's. Keyed by
        layer, so a stage whose counts are late leaves its layers out of this step instead of
        shifting the others."""
        pending = self.pool.expert_loads[self.replica]
        stages = pending.pop(mb_id, {})
        for stale in [mb for mb in pending if mb < mb_id]:   # never expected; not kept forever
            del pending[stale]
        layers: dict[int, list[int]] = {}
        for stage in sorted(stages):
            layers.update(stages[stage])
        layers.update(message.get("expert_load") or {})
        return layers or None

    @staticmethod
    def _sampled_rows(plan: StepPlan, message: dict):
        """(batch item, token, logprob) of each sampled row; the tokens come in plan order."""
        return zip(plan.sample_items, message["tokens"], message["logprobs"])

    def release(self, request_id: str) -> None:
        if request_id in self._known:
            self._known.discard(request_id)
            self._released.append(request_id)
        if self.tables is not None:
            self.tables.release(request_id)

    stops_on_close = True

    def close(self) -> None:
        self.pool.close()

    def reset_timeline(self) -> None:
        self.pool.reset_timeline()

    def pipeline_summary(self):
        """Per-rank busy time and bubble ratio, over all replicas (the pool is shared)."""
        return self.pool.stats.summary()

    def keep_timeline(self, max_events: int) -> None:
        self.pool.keep_events(max_events)

    def timeline(self, last: Optional[int] = None) -> list[dict]:
        """Events of every rank (the pool is shared by all replicas), oldest first."""
        events = self.pool.events
        if last is not None and len(events) > last:
            return list(itertools.islice(events, len(events) - last, None))
        return list(events)
