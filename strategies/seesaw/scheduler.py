"""Seesaw's scheduler (arXiv:2503.06433 §4.2, Fig. 6): pure Python over engine state.

Two phases, each in its own layout: prefill runs in c_p (e.g. PP=2), decode in c_d (e.g. TP=2).

- Prefill: whole prompts, first come first served, up to `max_num_batched_tokens` per
  micro-batch and up to c_p's depth in flight. A prompt is admitted only if the CPU store will
  have room for its KV; once prefilled (first token sampled) its KV is copied out to the store
  (overlapped with the next prefills) and its device blocks are freed.
- Decode: the prefetcher copies stored sequences in while the device cache has room (one free
  block kept per sequence on the device, so the next `block_size` steps cannot run out); the
  sequences that are in decode, one token each, split evenly over c_d's depth.
- Switches (`schedule`):
  * transition_minimizing (the paper): prefill -> decode when the store cannot take the next
    prompt (or no prompt is left); decode -> prefill when the store has drained onto the device
    and prompts are waiting. So a switch happens only with the store full or empty.
  * prefill_prioritizing (vLLM's default, Fig. 2): decode -> prefill as soon as a waiting prompt
    fits in the store beside the running sequences.
  * decode_prioritizing (Fig. 2): decode -> prefill only when every admitted sequence finished.
  Before a switch the pipeline drains; at decode -> prefill the sequences still decoding are
  copied out to the store (their KV is sharded for c_d; c_p reads it back from there later), and
  the layout changes only when no copy is in flight.

What the executor must do comes out of `take_actions()` (Transfer: a copy between tiers;
Reshard: switch every rank's layout); `on_transfers_done()` hears which copies finished.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.request import Sequence, SequenceStatus
from batchinfer.engine.scheduler import (BatchingScheduler, MicroBatch, ScheduledSeq,
                                         requeue_for_recompute)
from .executor import Reshard
from batchinfer.resharding.kv_tiers import SWAP_OUT, KVTiers, Transfer

PREFILL, DECODE = "prefill", "decode"
POLICIES = ("transition_minimizing", "prefill_prioritizing", "decode_prioritizing")
MAX_DECISIONS = 10_000


class SeesawScheduler(BatchingScheduler):
    """The queue (`waiting`, `add`, the token counts) is the baseline's; `running` holds only the
    sequences whose KV is on the device and that decode."""

    # a device block's KV is laid out for the phase that wrote it (prefill's PP, decode's TP):
    # another sample of a request computes its own prompt instead of sharing its first's blocks
    forks_prompt_blocks = False

    def __init__(self, device: BlockManager, store: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, prefill_depth: int = 1,
                 decode_depth: int = 1, policy: str = "transition_minimizing"):
        if policy not in POLICIES:
            raise ValueError(f"unknown Seesaw schedule {policy!r}; allowed: {', '.join(POLICIES)}")
        super().__init__(device, max_num_seqs, max(max_num_batched_tokens, max_model_len),
                         max_model_len)
        self.tiers = KVTiers(device, store)
        self.prefill_depth, self.decode_depth = prefill_depth, decode_depth
        self.policy = policy
        self.phase = PREFILL
        self.prefilling: list[Sequence] = []     # in a prefill micro-batch in flight
        self.stored: deque[Sequence] = deque()   # KV in the CPU store, to decode
        self.moving: dict[int, Sequence] = {}    # transfer id -> sequence
        self.num_switches = 0
        self.num_in_flight = 0
        self._draining = False                   # decode -> prefill: running copied out first
        self._actions: list = []
        self._decisions: list[dict] = []

    # --- the Scheduler protocol -----------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.stored or self.running or self.moving)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def layout(self) -> str:
        return self.phase

    @property
    def store_kv_usage(self) -> float:
        return self.tiers.store.usage()

    def step_stats(self) -> dict:
        return {"kv_store_usage": round(self.store_kv_usage, 4), "layout": self.layout}

    def schedule(self) -> list[MicroBatch]:
        if self.phase == PREFILL:
            batch = self._prefill_batch()
            if batch is not None:
                return [batch]
            if self._prefill_over() and self._quiet():
                self._switch(DECODE, self._prefill_reason())
            else:
                return []
        return self._decode()

    def on_result(self, batch: MicroBatch) -> None:
        self.num_in_flight -= 1
        for item in batch.items:
            seq = item.seq
            if batch.phase == PREFILL:
                self.prefilling.remove(seq)
                if seq.is_finished:
                    self.tiers.free(seq.request_id)
                else:
                    self._copy_out(seq)
            elif seq.is_finished:
                self.running.remove(seq)
                self.tiers.free(seq.request_id)

    def on_transfers_done(self, transfer_ids: list[int]) -> None:
        for tid in transfer_ids:
            transfer = self.tiers.complete(tid)
            seq = self.moving.pop(tid, None)
            if seq is None:          # aborted while its copy ran: drop what is left of it
                self.tiers.free(transfer.request_id)
            elif transfer.kind == SWAP_OUT:
                self.stored.append(seq)
            else:
                self.running.append(seq)

    def strategy_summary(self) -> dict:
        """Switches, the KV that moved between the tiers (tokens), the store's size and the most
        it held at once (more than the device cache holds only with the CPU tier; with KV layer
        groups both in tokens of sequences that release nothing: blocks / groups x block_size)."""
        store = self.tiers.store
        return {"num_switches": self.num_switches,
                "swapped_out_tokens": self.tiers.swapped_out_tokens,
                "swapped_in_tokens": self.tiers.swapped_in_tokens,
                "cpu_store_tokens": store.capacity_tokens,
                "cpu_store_peak_tokens": (self.tiers.peak_store_blocks // store.num_groups
                                          * store.block_size)}

    def take_actions(self) -> list:
        actions, self._actions = self._actions, []
        return actions

    def drain_decisions(self) -> list[dict]:
        out, self._decisions = self._decisions, []
        return out

    def abort_all(self) -> list[Sequence]:
        seqs = (list(self.waiting) + self.prefilling + list(self.stored) + self.running
                + list(self.moving.values()))
        for seq in seqs:
            if not self.tiers.is_moving(seq.request_id):
                self.tiers.free(seq.request_id)
        self.waiting.clear()
        self.stored.clear()
        self.moving.clear()      # their copies still report back: on_transfers_done drops them
        self.prefilling, self.running = [], []
        return seqs

    # --- prefill --------------------------------------------------------------------------------
    def _store_reserved_blocks(self) -> int:
        """Store blocks promised to prompts in flight (their copy-out has not started yet)."""
        return sum(self.tiers.store_blocks_for(seq.num_tokens) for seq in self.prefilling)

    def _next_prompt_fits_store(self) -> bool:
        return bool(self.waiting) and self.tiers.can_swap_out(
            self.waiting[0].num_uncomputed_tokens, self._store_reserved_blocks())

    def _prefill_batch(self) -> Optional[MicroBatch]:
        if self._draining or self.num_in_flight >= self._depth():
            return None
        batch = self._whole_prompts()
        if not batch.items:
            return None
        self.num_in_flight += 1
        return batch

    def _admit(self, seq: Sequence, num_tokens: int) -> bool:
        """The baseline's whole-prompt batching admits through here: the prompt needs room in the
        store (for its copy-out) and on the device (until the copy is done)."""
        if not self._next_prompt_fits_store():
            return False
        if not self.block_manager.can_grow(seq.request_id, seq.num_computed_tokens + num_tokens):
            return False     # the device is full until copies out finish
        self.waiting.popleft()
        self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.prefilling.append(seq)
        return True

    def _prefill_over(self) -> bool:
        return not self.waiting or not self._next_prompt_fits_store()

    def _prefill_reason(self) -> str:
        return "no prompt left" if not self.waiting else "CPU store full"

    def _copy_out(self, seq: Sequence) -> None:
        # a prompt's windowed tables hold its whole context until released: what its next
        # query cannot see is neither copied nor stored (a decoding one released after its step)
        self.block_manager.release_outside_window(seq.request_id, seq.num_computed_tokens)
        transfer = self.tiers.swap_out(seq.request_id, seq.num_computed_tokens)
        self._start(transfer, seq)

    def _start(self, transfer: Transfer, seq: Sequence) -> None:
        self.moving[transfer.transfer_id] = seq
        self._actions.append(transfer)

    # --- decode ---------------------------------------------------------------------------------
    def _decode(self) -> list[MicroBatch]:
        if not self._draining and self._want_prefill():
            self._draining = True
        if self._draining:
            if self.num_in_flight:
                return []
            if not self.running or self._room_to_prefill():
                return self._drain_to_prefill()
            self._draining = False    # the decodes that were in flight grew past the room
        self._copy_in()
        return self._decode_batches()

    def _want_prefill(self) -> bool:
        if not self.waiting or not self._room_to_prefill():
            return False
        if self.policy == "transition_minimizing":
            return not self.stored and not self._moving_in()
        if self.policy == "decode_prioritizing":
            return not (self.stored or self.running or self.moving)
        return True   # prefill_prioritizing: as soon as the next prompt fits

    def _room_to_prefill(self) -> bool:
        """The store takes the sequences on the device (copied out at the switch) and the next
        prompt; otherwise a switch would find nothing to prefill."""
        on_device = sum(self.tiers.store_blocks_for(s.num_computed_tokens)
                        for s in self.running + list(self.moving.values()))
        return self.tiers.can_swap_out(self.waiting[0].num_uncomputed_tokens, on_device)

    def _moving_in(self) -> bool:
        return any(t.kind != SWAP_OUT for t in self.tiers.pending.values())

    def _drain_to_prefill(self) -> list[MicroBatch]:
        """Copies the running sequences out (nothing in flight), then switches."""
        while self.running:
            seq = self.running.pop()
            if self.tiers.can_swap_out(seq.num_computed_tokens):
                self._copy_out(seq)
            else:
                self._recompute_later(seq)
        if self.moving:
            return []
        self._draining = False
        self._switch(PREFILL, "CPU store drained" if self.policy == "transition_minimizing"
                     else self.policy.replace("_", "-"))
        batch = self._prefill_batch()
        return [batch] if batch is not None else []

    def _copy_in(self) -> None:
        """The prefetcher's work: stored sequences onto the device while it has room."""
        on_device = len(self.running) + sum(1 for t in self.tiers.pending.values()
                                            if t.kind != SWAP_OUT)
        while self.stored and on_device < self.max_num_seqs:
            seq = self.stored[0]
            # keep one free block per sequence on the device: the next steps cannot run out
            if not self.tiers.can_swap_in(seq.num_computed_tokens, on_device + 1):
                break
            self.stored.popleft()
            self._start(self.tiers.swap_in(seq.request_id, seq.num_computed_tokens), seq)
            on_device += 1

    def _decode_batches(self) -> list[MicroBatch]:
        slots = self._depth() - self.num_in_flight
        idle = [seq for seq in self.running if not seq.in_flight]
        if slots <= 0 or not idle:
            return []
        in_flight = len(self.running) - len(idle)
        # even split of every decoding sequence over the depth; this micro-batch takes its share
        share = -(-len(self.running) // self._depth())
        take = idle[: max(1, share if in_flight else -(-len(idle) // slots))]
        batch = MicroBatch(phase=DECODE)
        scheduled: set[int] = set()
        evicted: set[int] = set()
        for seq in take:
            if id(seq) in evicted:           # went back to the store for an earlier one
                continue
            if self._grow(seq, scheduled, evicted):
                batch.items.append(ScheduledSeq(seq, 1))
                scheduled.add(id(seq))
        if not batch.items:
            return []
        self.num_in_flight += 1
        return [batch]

    def _grow(self, seq: Sequence, scheduled: set[int], evicted: set[int]) -> bool:
        """Room for one more token of `seq`: the newest idle sequence not yet in this
        micro-batch goes back to the store (recomputed later if the store is full)."""
        target = seq.num_computed_tokens + 1
        while not self.block_manager.can_grow(seq.request_id, target):
            victims = [s for s in self.running
                       if not s.in_flight and s is not seq and id(s) not in scheduled]
            if not victims:
                return False
            victim = victims[-1]
            evicted.add(id(victim))
            self.running.remove(victim)
            self.num_preemptions += 1
            if self.tiers.can_swap_out(victim.num_computed_tokens):
                self._copy_out(victim)
            else:
                self._recompute_later(victim)
        self.block_manager.grow(seq.request_id, target)
        return True

    def _recompute_later(self, seq: Sequence) -> None:
        self.tiers.free(seq.request_id)
        requeue_for_recompute(seq, self.waiting)

    # --- switches -------------------------------------------------------------------------------
    def _depth(self) -> int:
        return self.prefill_depth if self.phase == PREFILL else self.decode_depth

    def _quiet(self) -> bool:
        return self.num_in_flight == 0 and not self.moving

    def _switch(self, phase: str, reason: str) -> None:
        self.phase_before, self.phase = self.phase, phase
        self.num_switches += 1
        self._actions.append(Reshard(phase))
        if len(self._decisions) < MAX_DECISIONS:
            self._decisions.append({
                "switch": f"{self.phase_before}->{phase}", "reason": reason,
                "waiting": len(self.waiting), "in_store": len(self.stored),
                "on_device": len(self.running),
                "store_usage": round(self.tiers.store.usage(), 4),
                "device_usage": round(self.block_manager.usage(), 4)})

    def check_invariants(self) -> None:
        self.tiers.check_invariants()
        for seq in self.stored:
            assert self.tiers.store.block_table(seq.request_id), seq.request_id
            assert not self.block_manager.block_table(seq.request_id), seq.request_id
        for seq in self.running:
            assert self.block_manager.block_table(seq.request_id), seq.request_id
            assert not self.tiers.store.block_table(seq.request_id), seq.request_id
