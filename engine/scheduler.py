"""The Scheduler seam and the baseline batching policies the papers compare against.

A scheduler decides what runs next: `schedule()` returns micro-batches (which sequences, how many
of their tokens), `on_result()` is told what completed. It is pure Python over engine state (the
sequences and the block manager), with no torch and no I/O, so the same object runs in the real
engine, in the simulator and in unit tests.

The baseline policies built on `BatchingScheduler` (engine/batching_policies.py):
- `SeparateBatching` (SB): a step is either all-prefill (whole prompts, FCFS, under the token
  budget) or all-decode; prefill has priority, as in vLLM's original scheduler.
- `HybridBatching` (HB, Sarathi-Serve / vLLM v1): every step first takes one token of every running
  decode, then fills the rest of the token budget with prefill chunks (at most `chunk_size` each).
Both preempt by recompute when KV blocks run out: the newest running sequence loses its blocks
and goes back to the front of the queue, to be prefilled again later. With a swap area
(memory.preemption_mode: swap, kv_swap.py) its KV is copied out instead and copied back before any
new request is admitted, as vLLM's swap mode. With prefix caching on in
the block manager, a sequence starts from the cached blocks of its tokens (also after a
preemption) and its full blocks are indexed as their results come back.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache import BlockManager
from .request import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # tokens of this sequence computed in this micro-batch

    @property
    def is_decode(self) -> bool:
        """One new token after a fully computed context (valid before the step is applied)."""
        seq = self.seq
        return (self.num_tokens == 1 and seq.num_computed_tokens == seq.num_tokens - 1
                and seq.num_computed_tokens >= seq.prompt_len)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class MicroBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    phase: str = "mixed"     # prefill | decode | mixed
    # prompt positions to score (prompt_logprobs.PromptSlice), set by the engine before the
    # batch runs; None when no item asks
    prompt_scores: Optional[list] = None

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def num_decode_tokens(self) -> int:
        """Valid until the engine applies the step (it reads the sequences' progress)."""
        return sum(1 for item in self.items if item.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    def __len__(self) -> int:
        return len(self.items)


class Scheduler:
    """The Scheduler seam: what runs next, as pure Python over engine state (no torch, no I/O), so
    the same object runs in the real engine, in the simulator and in unit tests.

    A scheduler implements the first five methods. The rest are capabilities the engine always
    calls, whose defaults mean "none": a strategy overrides what it has (its step statistics, its
    decisions, KV moves between tiers) and the engine never asks which scheduler it holds."""

    block_manager: BlockManager
    num_preemptions: int = 0
    forks_prompt_blocks = True     # parallel sampling: samples share the first's prompt blocks

    def add(self, seq: Sequence) -> None:
        raise NotImplementedError

    def add_next(self, seq: Sequence) -> None:
        """To the head of the queue: another sample of a running request (parallel sampling)."""
        self.add(seq)

    def schedule(self) -> list[MicroBatch]:
        raise NotImplementedError

    def on_result(self, batch: MicroBatch) -> None:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def abort_all(self) -> list[Sequence]:
        raise NotImplementedError

    # --- load, by which the engine feeds data-parallel replicas from its shared queue ----------
    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def num_running(self) -> int:
        return 0

    @property
    def num_swapped(self) -> int:
        """Preempted sequences waiting in the swap area (memory.preemption_mode: swap)."""
        return 0

    @property
    def num_waiting_tokens(self) -> int:
        return 0

    @property
    def feed_tokens(self) -> int:
        """Waiting prompt tokens below which this replica takes more from the shared queue."""
        return 0

    def in_flight_limit(self, depth: int) -> int:
        """Micro-batches to keep in flight on a pipeline of `depth` stages (the executor's
        max_in_flight): one per stage, unless what the scheduler launches does not depend on
        what is in flight and it launches further ahead."""
        return depth

    # --- what the report shows -------------------------------------------------------------------
    def step_stats(self) -> dict:
        """Values of this step for the step event (the report's timeline and plots render any
        key they know: kv_predicted, kv_store_usage, layout, ...)."""
        return {}

    def drain_decisions(self) -> list[dict]:
        """Decisions taken since the last call (phase switches, budgets), for the step event."""
        return []

    def strategy_summary(self) -> dict:
        """Totals of the strategy's own for the report's strategy_stats."""
        return {}

    # --- KV moves between tiers and layout switches (carried out by the executor) -------------
    def take_actions(self) -> list:
        """Actions for the executor's run_actions() before the next micro-batches."""
        return []

    def on_transfers_done(self, done: list) -> None:
        """The executor's finished copies (its take_done_transfers())."""


class BatchingScheduler(Scheduler):
    """Queues, admission and preemption shared by the baseline policies."""

    # prefix caching: the head of the queue waits for a shared prefix another sequence is
    # computing (off for schedulers whose phases an empty prefill batch would end)
    wait_for_shared_prefix = True
    # preempted sequences go to the block manager's swap area where it has one: only for a
    # policy that brings them back (_swap_in)
    swaps_preempted = False

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()     # preempted with their KV in the swap area
        self.num_preemptions = 0
        self.pool_sharers: Optional[Scheduler] = None   # VirtualEngines: the pool's schedulers

    # --- bookkeeping ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_next(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.swapped)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def pool_has_swapped(self) -> bool:
        """Whether a sequence of this KV pool waits in the swap area (under VirtualEngines, of
        any scheduler sharing the pool): new prompts wait while one does."""
        owner = self.pool_sharers if self.pool_sharers is not None else self
        return owner.num_swapped > 0

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_uncomputed_tokens for seq in self.waiting)

    @property
    def feed_tokens(self) -> int:
        """Data parallelism hands this replica new requests while fewer tokens than this wait."""
        return 2 * self.max_num_batched_tokens

    def _schedulable(self) -> list[Sequence]:
        """Running sequences not inside an in-flight micro-batch (its results decide their next
        step); oldest first, so preemption victims come from the end."""
        return [seq for seq in self.running if not seq.in_flight]

    def on_result(self, batch: MicroBatch) -> None:
        """Indexes the blocks the step filled (prefix caching), frees the finished sequences'
        blocks; everything else stays where it is."""
        bm = self.block_manager
        if bm.prefix is not None:
            for item in batch.items:
                seq = item.seq
                bm.computed(seq.request_id, seq.num_computed_tokens)
                if bm.has_uncached_blocks(seq.request_id, seq.num_computed_tokens):
                    bm.cache_computed(seq.request_id, seq.token_ids(), seq.num_computed_tokens,
                                      seq.request.prefix_root)     # its LoRA adapter's chain
        finished = [item.seq for item in batch.items if item.seq.is_finished]
        for seq in finished:
            self.block_manager.free(seq.request_id)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]

    def abort_all(self) -> list[Sequence]:
        seqs = list(self.running) + list(self.swapped) + list(self.waiting)
        for seq in self.running + list(self.waiting):    # waiting: a forked sample's blocks
            self.block_manager.free(seq.request_id)
        for seq in self.swapped:
            self.block_manager.swap.discard(seq.request_id)
        if self.block_manager.swap is not None:
            self.block_manager.swap.take_ops()          # copies for sequences no longer here
        self.running.clear()
        self.swapped.clear()
        self.waiting.clear()
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        """Swapped out where there is a swap area with room (memory.preemption_mode: swap),
        else recomputed."""
        self.running.remove(seq)
        self.num_preemptions += 1
        swap = self.block_manager.swap if self.swaps_preempted else None
        if swap is not None and swap.can_swap_out(seq.num_computed_tokens):
            swap.swap_out(self.block_manager, seq.request_id, seq.num_computed_tokens)
            seq.num_preemptions += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.block_manager.free(seq.request_id)
        requeue_for_recompute(seq, self.waiting)

    def _swap_in(self, admits=None) -> list[Sequence]:
        """Brings swapped sequences back, oldest first, while the device has room for each and
        its next token (above the watermark while others run) and `admits(seq)` (a policy's own
        check, asked only while others run) agrees. Each rejoins `running` in arrival order, so
        the next preemption takes a newer one first (vLLM's FCFS). -> those brought back."""
        back: list[Sequence] = []
        bm = self.block_manager
        next_tokens = 0     # blocks those brought back still need for their next tokens
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            need = bm.blocks_needed(seq.request_id, seq.num_computed_tokens + 1)
            reserve = bm.watermark_blocks if self.running else 0
            if need + next_tokens > bm.num_free_blocks - reserve:
                break
            if admits is not None and self.running and not admits(seq):
                break
            self.swapped.popleft()
            next_tokens += need - bm.blocks_needed(seq.request_id, seq.num_computed_tokens)
            bm.swap.swap_in(bm, seq.request_id, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            arrival = seq.request.arrival_index
            at = next((i for i, other in enumerate(self.running)
                       if other.request.arrival_index > arrival), len(self.running))
            self.running.insert(at, seq)
            back.append(seq)
        return back

    def _reserve(self, seq: Sequence, num_tokens: int, victims_from: list[Sequence]) -> bool:
        """Makes room for `num_tokens` more tokens of a running `seq`, preempting the newest
        running sequences (never `seq` itself unless it is the newest); False if `seq` was."""
        target = seq.num_computed_tokens + num_tokens
        while not self.block_manager.can_grow(seq.request_id, target):
            victim = victims_from[-1] if victims_from else None
            if victim is None:
                return False
            victims_from.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq.request_id, target)
        return True

    def _whole_prompts(self) -> MicroBatch:
        """A prefill micro-batch: whole prompts from the head of the queue (FCFS) while they fit
        the token budget (the first one always does) and can be admitted."""
        batch = MicroBatch(phase="prefill")
        budget = self.max_num_batched_tokens
        while self.waiting:
            seq = self.waiting[0]
            self._match_prefix(seq)
            if self._waits_for_prefix(seq):
                break
            need = seq.num_uncomputed_tokens
            if need > budget and batch.items:
                break
            if not self._admit(seq, need):
                break
            batch.items.append(ScheduledSeq(seq, need))
            budget -= need
            if budget <= 0:
                break
        return batch

    def _match_prefix(self, seq: Sequence) -> None:
        """Prefix caching: the head of the queue, holding no KV yet, starts from the cached
        blocks of its tokens (given back by _admit if it cannot start now). A request that
        scores its prompt (prompt_logprobs) computes every position, as vLLM's
        skip_reading_prefix_cache."""
        bm = self.block_manager
        if bm.prefix is not None and seq.num_computed_tokens == 0 and \
                not bm.block_table(seq.request_id) and seq.request.sampling.prompt_logprobs is None:
            seq.num_computed_tokens = bm.match_prefix(seq.request_id, seq.token_ids(),
                                                      seq.request.prefix_root)

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Prefix caching: the head of the queue waits while a running sequence computes the
        next block of its prefix, so a shared prefix is computed once (then read from the
        cache), not once per sequence admitted beside the first."""
        bm = self.block_manager
        if bm.prefix is None or not self.wait_for_shared_prefix or \
                seq.request.sampling.prompt_logprobs is not None or \
                not bm.computing_elsewhere(seq.request_id, seq.token_ids(), seq.request.prefix_root):
            return False
        if seq.num_computed_tokens:           # its matched blocks go back to the cache
            bm.free(seq.request_id)
            seq.num_computed_tokens = 0
        return True

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Room above the watermark (headroom for running decodes; with none it would stall)."""
        return len(self.running) < self.max_num_seqs and self.block_manager.can_grow(
            seq.request_id, seq.num_computed_tokens + num_tokens, keep_watermark=bool(self.running))

    def _room_from_waiting(self, seq: Sequence, num_tokens: int) -> bool:
        """Without a cache, a waiting sequence's blocks are a sample's shared prompt, kept while
        others run; with none running they are let go. -> whether `seq` fits now."""
        if self.running or self.block_manager.prefix is not None:
            return False
        for other in self.waiting:
            if other is not seq and other.num_computed_tokens:
                self.block_manager.free(other.request_id)
                other.num_computed_tokens = 0
        return self._fits(seq, num_tokens)

    def _admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Moves the head of the queue to running if its first chunk fits above the watermark."""
        if not self._fits(seq, num_tokens) and not self._room_from_waiting(seq, num_tokens):
            if seq.num_computed_tokens and self.block_manager.prefix is not None:
                self.block_manager.free(seq.request_id)   # matched blocks: back to the cache
                seq.num_computed_tokens = 0
            return False
        if self.block_manager.prefix is not None:
            self.block_manager.count_admission(seq.num_tokens, seq.num_computed_tokens)
            self.block_manager.start_computing(seq.request_id, seq.token_ids(),
                                               seq.request.prefix_root)
        self.waiting.popleft()
        self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True


def requeue_for_recompute(seq: Sequence, waiting: deque) -> None:
    """Preemption by recompute: the sequence lost its KV and goes back to the queue's front."""
    seq.num_computed_tokens = 0
    seq.num_preemptions += 1
    seq.status = SequenceStatus.WAITING
    waiting.appendleft(seq)


def phase_of(items: list[ScheduledSeq]) -> str:
    kinds = {item.is_decode for item in items}
    if kinds == {False}:
        return "prefill"
    if kinds == {True}:
        return "decode"
    return "mixed"
