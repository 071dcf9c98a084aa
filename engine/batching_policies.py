"""The baseline batching policies the papers compare against, over engine/scheduler.py's
`BatchingScheduler` (its queues, preemption, swap-in and admission): SB and HB, and the factory
that builds one from a SchedulerConfig (one per pipeline slot under PP)."""
from __future__ import annotations

from typing import Optional

from .kv_cache import BlockManager
from .request import SequenceStatus
from .scheduler import BatchingScheduler, MicroBatch, ScheduledSeq, phase_of


class SeparateBatching(BatchingScheduler):
    """SB: prefill-only steps (whole prompts) take priority; otherwise one decode step for all."""

    swaps_preempted = True

    def schedule(self) -> list[MicroBatch]:
        if not self.pool_has_swapped():       # new prompts wait while swapped sequences do
            batch = self._whole_prompts()
            if batch.items:
                return [batch]
        batch = MicroBatch(phase="decode")
        preemptions_before = self.num_preemptions
        order = self._schedulable()
        for seq in list(order):
            if seq.status is not SequenceStatus.RUNNING:    # preempted by an earlier one
                continue
            if self._reserve(seq, 1, order):
                batch.items.append(ScheduledSeq(seq, 1))
        if self.num_preemptions == preemptions_before:     # as vLLM: only if none was preempted
            for seq in self._swap_in():
                if self._reserve(seq, 1, []):
                    batch.items.append(ScheduledSeq(seq, 1))
        return [batch] if batch.items else []


class HybridBatching(BatchingScheduler):
    """HB: decodes first, then prefill chunks fill the token budget (chunked prefill)."""

    swaps_preempted = True

    def __init__(self, *args, chunk_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_size = chunk_size or self.max_num_batched_tokens

    def schedule(self) -> list[MicroBatch]:
        batch = MicroBatch(phase="mixed")
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        order = self._schedulable()
        for seq in list(order):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            want = min(seq.num_uncomputed_tokens, self.chunk_size, budget)
            if self._reserve(seq, want, order):
                batch.items.append(ScheduledSeq(seq, want))
                budget -= want
        # As vLLM: swapped sequences come back only in a step that preempted none; after a
        # preemption, or while one waits to come back, nothing new is admitted.
        if self.num_preemptions == preemptions_before:
            for seq in self._swap_in():
                want = min(seq.num_uncomputed_tokens, self.chunk_size, budget)
                if want > 0 and self._reserve(seq, want, []):
                    batch.items.append(ScheduledSeq(seq, want))
                    budget -= want
        while self.waiting and budget > 0 and self.num_preemptions == preemptions_before \
                and not self.pool_has_swapped():
            seq = self.waiting[0]
            self._match_prefix(seq)
            if self._waits_for_prefix(seq):
                break
            want = min(seq.num_uncomputed_tokens, self.chunk_size, budget)
            if not self._admit(seq, want):
                break
            batch.items.append(ScheduledSeq(seq, want))
            budget -= want
        if not batch.items:
            return []
        batch.phase = phase_of(batch.items)
        return [batch]


def scheduler_from_config(cfg, block_manager: BlockManager, max_model_len: int,
                          pipeline_depth: int = 1):
    """The baseline policy a SchedulerConfig describes (one replica's scheduler)."""
    return make_scheduler(cfg.policy, block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                          max_model_len, cfg.chunk_size, pipeline_depth=pipeline_depth)


def make_scheduler(policy: str, block_manager: BlockManager, max_num_seqs: int,
                   max_num_batched_tokens: int, max_model_len: int,
                   chunk_size: Optional[int] = None, pipeline_depth: int = 1):
    """The baseline policy; with pipeline_depth > 1, one virtual engine per pipeline slot
    (max_num_seqs is the total, split between them)."""
    if pipeline_depth > 1:
        from .virtual_engines import VirtualEngines

        per_engine = max(1, -(-max_num_seqs // pipeline_depth))
        return VirtualEngines([make_scheduler(policy, block_manager, per_engine,
                                              max_num_batched_tokens, max_model_len, chunk_size)
                               for _ in range(pipeline_depth)])
    if policy == "sb":
        return SeparateBatching(block_manager, max_num_seqs, max(max_num_batched_tokens, max_model_len),
                                max_model_len)
    if policy == "hb":
        return HybridBatching(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                              chunk_size=chunk_size)
    raise ValueError(f"unknown batching policy {policy!r}; allowed: sb, hb")
