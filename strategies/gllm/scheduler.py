"""Strategy `gllm`: Token Throttling for balanced pipeline micro-batches
(arXiv:2504.14775 §3).

Every micro-batch is scheduled in two independent halves, then merged into one hybrid batch
(prefill chunks and decode tokens together), up to PP micro-batches in flight:

- decode throttling (§3.2, eq. 4): #D = #RD / #PP_depth, #RD the requests in decode (those in
  flight included); the oldest idle decodes up to #D go in. Deterministic: the same state always
  gives the same split. Off (`decode_throttling: false`): every idle decode goes in, as
  Sarathi-Serve does.
- prefill throttling (§3.1, eq. 3): #P = max(min(#WP / #T, #MaxP x (KV_free - KV_thresh) /
  (1 - KV_thresh)), #MinP), #WP the prompt tokens still to prefill, KV_free the share of free KV
  blocks; prefill is suspended while KV_free < KV_thresh. `WT: false` drops the #WP term (eq. 2
  with the threshold), `UT: false` the KV term (eq. 1); both off: a fixed #MaxP. Prompts are
  taken first come first served (a started prompt's next chunk first); the last one that does
  not fit the budget is chunked. A started prompt whose next chunk does not fit preempts newer
  idle requests, and with nothing in flight the oldest prompt goes on with #MinP tokens (prompts
  that each hold part of the cache would otherwise wait for one another forever).

Unlike the baseline's virtual engines (one scheduler per pipeline slot, each with its own
requests), one scheduler sees every request, so the split is global.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from pydantic import Field, model_validator

from batchinfer.engine.config import SchedulerConfig
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.strategies.base import StrategyParams, register_strategy
from batchinfer.engine.request import Sequence, SequenceStatus
from batchinfer.engine.scheduler import BatchingScheduler, MicroBatch, ScheduledSeq, phase_of


class GLLMParams(StrategyParams):
    """gLLM's hyperparameters under the paper's names and defaults (§4.1), with its ablations."""

    name: Literal["gllm"] = "gllm"
    kv_layer_groups: ClassVar[bool] = True
    swaps_preempted: ClassVar[bool] = False     # Token Throttling's scheduler recomputes
    T: int = Field(8, ge=1, description="#T: iterations to prefill every waiting token (WT)")
    MaxP: int = Field(2048, ge=1, description="#MaxP: most prefill tokens in one micro-batch")
    MinP: int = Field(32, ge=1, description="#MinP: fewest prefill tokens in one micro-batch "
                      "(while any wait and the KV cache is above the threshold)")
    KV_thresh: float = Field(0.05, ge=0.0, lt=1.0, description="KV_thresh: prefill is suspended "
                             "while the free share of the KV cache is below this")
    WT: bool = Field(True, description="throttle prefill by the tokens waiting (eq. 1); off: the "
                     "paper's 'w/o WT'")
    UT: bool = Field(True, description="throttle prefill by KV cache utilization (eq. 2); off: "
                     "the paper's 'w/o UT'")
    decode_throttling: bool = Field(True, description="#D = #RD / PP depth decodes per "
                                    "micro-batch (eq. 4); off: every idle decode")
    max_num_seqs: int = Field(1024, ge=1, description="most requests holding KV at once")
    preemptive_metadata: bool = Field(True, description="the runtime's preemptive metadata "
                                      "scheduling (§3.3 (3)): each worker prepares a micro-batch's "
                                      "inputs as soon as its metadata arrives, overlapped with the "
                                      "computation before it; off: inline after the activations' "
                                      "receive")

    @model_validator(mode="after")
    def _min_below_max(self):
        if self.MinP > self.MaxP:
            raise ValueError(f"MinP ({self.MinP}) must not exceed MaxP ({self.MaxP})")
        return self

    def prepares_inputs_ahead(self) -> bool:
        return self.preemptive_metadata

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(policy="hb", max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=max(self.MaxP, 16))

    def make_scheduler(self, block_manager: BlockManager, max_model_len: int,
                       pipeline_depth: int) -> "TokenThrottlingScheduler":
        return TokenThrottlingScheduler(block_manager, self, max_model_len, pipeline_depth)


    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        return pp >= 2          # a pipeline mechanism: nothing to do without stages

    def layout_note(self, parallel) -> Optional[str]:
        return self.pipeline_only_note(parallel)

    def idle_switches(self) -> list[tuple[str, str]]:
        return self.idle_unless(self.WT, "strategy.WT is false (eq. 1, which T divides, is off)",
                                "T")

    @classmethod
    def search_params(cls, knobs: SchedulerConfig) -> list[tuple[str, dict]]:
        return [("gllm", {"name": "gllm", "max_num_seqs": knobs.max_num_seqs})]


register_strategy("gllm", GLLMParams)


# --- the formulas ------------------------------------------------------------------------------------
def prefill_budget(params: GLLMParams, waiting_tokens: int, kv_free: float) -> int:
    """#P for this micro-batch (eq. 3, or eq. 1 / eq. 2 / #MaxP under the ablations); 0 when
    nothing waits or the KV cache is below the threshold. Never more than what waits."""
    if waiting_tokens <= 0 or kv_free < params.KV_thresh:
        return 0
    limits = []
    if params.WT:
        limits.append(waiting_tokens / params.T)
    if params.UT:
        limits.append(params.MaxP * (kv_free - params.KV_thresh) / (1.0 - params.KV_thresh))
    budget = min(limits) if limits else params.MaxP
    budget = min(max(math.ceil(budget), params.MinP), params.MaxP)
    return min(budget, waiting_tokens)


def decode_budget(running_decodes: int, depth: int) -> int:
    """#D = #RD / #PP_depth (eq. 4), rounded up so every decode runs once per PP micro-batches."""
    return -(-running_decodes // max(depth, 1))


def is_decoding(seq: Sequence) -> bool:
    """Prompt (and any recomputed output) in the cache: one new token per step from now on."""
    return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.prompt_len


@dataclass
class ThrottleDecision:
    """What the last micro-batch was given and from what (the report's inputs per decision)."""

    waiting_tokens: int
    kv_free: float
    running_decodes: int
    prefill_budget: int
    decode_budget: int


class TokenThrottlingScheduler(BatchingScheduler):
    def __init__(self, block_manager: BlockManager, params: GLLMParams, max_model_len: int,
                 depth: int):
        super().__init__(block_manager, params.max_num_seqs, params.MaxP, max_model_len)
        self.params = params
        self.depth = max(depth, 1)
        self.last_decision: Optional[ThrottleDecision] = None
        self.num_suspended = 0       # micro-batches scheduled while prefill was suspended
        self._suspended = False
        self._decisions: list[dict] = []
        self._chunk_in_flight: dict[int, int] = {}     # id(seq) -> prompt tokens in flight

    @property
    def feed_tokens(self) -> int:
        """WT needs #T x #MaxP tokens waiting to reach #MaxP per micro-batch."""
        return self.params.T * self.params.MaxP

    @property
    def kv_free(self) -> float:
        return self.block_manager.num_free_blocks / self.block_manager.num_blocks

    def _decoding(self) -> list[Sequence]:
        return [seq for seq in self.running if is_decoding(seq)]

    def _prefill_queue(self) -> list[Sequence]:
        """Started prompts (next chunk) first, then the waiting queue, both first come first
        served; in-flight chunks are not ready yet."""
        started = [seq for seq in self.running if not is_decoding(seq) and not seq.in_flight]
        return started + list(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """#WP: prompt tokens still to prefill and not yet in a micro-batch, of queued and of
        partly prefilled requests."""
        started = sum(seq.num_uncomputed_tokens - self._chunk_in_flight.get(id(seq), 0)
                      for seq in self.running if not is_decoding(seq))
        return started + super().num_waiting_tokens

    def on_result(self, batch: MicroBatch) -> None:
        for item in batch.items:
            self._chunk_in_flight.pop(id(item.seq), None)
        super().on_result(batch)

    def schedule(self) -> list[MicroBatch]:
        decodes = self._decoding()
        d_budget = (decode_budget(len(decodes), self.depth) if self.params.decode_throttling
                    else len(decodes))
        waiting_tokens = self.num_waiting_tokens
        batch = MicroBatch()
        preemptions_before = self.num_preemptions
        order = self._schedulable()
        for seq in [s for s in decodes if not s.in_flight]:
            if len(batch.items) >= d_budget:
                break
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1, order):
                batch.items.append(ScheduledSeq(seq, 1))
        # the KV share left once this micro-batch's decodes hold their slots (Fig. 7: KV is
        # allocated for a micro-batch before it runs)
        kv_free = self.kv_free
        p_budget = prefill_budget(self.params, waiting_tokens, kv_free)
        self._note_suspension(waiting_tokens > 0 and kv_free < self.params.KV_thresh, kv_free)
        if self.num_preemptions == preemptions_before:    # as vLLM: no prefill after a preemption
            self._add_prefill(batch, p_budget)
        if not batch.items and not any(seq.in_flight for seq in self.running):
            # nothing runs and nothing will come back to free blocks (prompts started earlier
            # hold the cache below KV_thresh): the oldest goes on with #MinP tokens, preempting
            # newer ones, or the job would stall
            self._add_prefill(batch, self.params.MinP)
        self.last_decision = ThrottleDecision(waiting_tokens, round(kv_free, 4), len(decodes),
                                              p_budget, d_budget)
        if not batch.items:
            return []
        batch.phase = phase_of(batch.items)
        return [batch]

    def _note_suspension(self, suspended: bool, kv_free: float) -> None:
        """Counts suspended micro-batches; records each suspend / resume for the report."""
        self.num_suspended += suspended
        if suspended != self._suspended and len(self._decisions) < 10_000:
            self._decisions.append({
                "switch": "prefill suspended" if suspended else "prefill resumed",
                "reason": (f"KV free {kv_free:.1%} {'<' if suspended else '>='} KV_thresh "
                           f"{self.params.KV_thresh:.1%}"),
                "running": len(self.running), "waiting": len(self.waiting)})
        self._suspended = suspended

    def _idle_outside(self, batch: MicroBatch, seq: Sequence) -> list[Sequence]:
        """Whom a started prompt's next chunk may preempt (newest last): idle requests outside
        this micro-batch. Without it, prompts that each hold part of the cache would wait for
        one another forever."""
        inside = {id(item.seq) for item in batch.items}
        return [s for s in self.running if not s.in_flight and s is not seq and id(s) not in inside]

    def drain_decisions(self) -> list[dict]:
        out, self._decisions = self._decisions, []
        return out

    def abort_all(self) -> list[Sequence]:
        self._suspended = False
        self._chunk_in_flight.clear()
        return super().abort_all()

    def _add_prefill(self, batch: MicroBatch, budget: int) -> None:
        for seq in self._prefill_queue():
            if budget <= 0:
                return
            if seq.status is SequenceStatus.WAITING:
                self._match_prefix(seq)
                if self._waits_for_prefix(seq):
                    return
            take = min(seq.num_uncomputed_tokens, budget)
            if seq.status is SequenceStatus.WAITING:
                if not self._admit(seq, take):
                    return                 # FCFS: nothing overtakes a prompt that cannot start
            elif not self._reserve(seq, take, self._idle_outside(batch, seq)):
                return
            batch.items.append(ScheduledSeq(seq, take))
            self._chunk_in_flight[id(seq)] = take
            budget -= take
