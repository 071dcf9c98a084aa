"""Strategy `tdpipe`: temporally-disaggregated pipeline parallelism (arXiv:2506.10470).

The pipeline alternates long prefill-only phases and long decode-only phases:

- prefill phase: whole prompts packed into micro-batches of up to `max_num_batched_tokens`
  tokens, launched back to back (they do not depend on each other; up to 2 x PP in flight,
  `launch_prefills_ahead`). After each launch the
  predicted KV usage at future decode points is updated (Algorithm 1); when its peak exceeds
  the capacity (x `kv_safety_ratio`) the phase ends (`greedy_prefill`; ablation: a fixed
  `kv_occupancy_ratio` of the blocks in use). It also ends when the next prompt does not fit,
  or (`admit_within_capacity`, by default once the job has preempted a request) when its
  forecast would take the peak over the capacity: that prompt waits instead of being launched
  and preempted in decode.
- decode phase: the running requests split into PP batches that cycle through the pipeline,
  exactly PP in flight; inter-batch work stealing keeps them even (`work_stealing`). At each
  returning batch, the spatial intensity of decoding on is compared with the temporal intensity
  of the next prefill cycle (`intensity_switch`; ablation: a fixed `finished_ratio` of the
  phase's requests done). A request that runs out of KV is preempted and recomputed later
  (the paper's choice), or with `memory.preemption_mode: swap` its KV goes to the host's swap
  area and comes back in a decode phase once Algorithm 1's forecast of the running requests
  leaves it room; no new prompt is admitted while one waits there.

Decisions go into the report (`strategy_decisions`): every phase switch with the inputs that
decided it, and the predicted vs actual KV usage of each decode step (paper Fig. 12).
The policy arithmetic lives in policy.py, the parameters in params.py; this module applies them
to engine state.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.request import Sequence, SequenceStatus
from batchinfer.engine.scheduler import BatchingScheduler, MicroBatch, ScheduledSeq
from batchinfer.engine.step_times import StepTimes

from .params import TDPipeParams
from .policy import (KVForecast, WorkStealing, forecast_length, future_points, intensities,
                     pack_prefill)

__all__ = ["TDPipeParams", "TDPipeScheduler"]     # the parameters live in params.py

log = logging.getLogger("batchinfer")

PREFILL_AHEAD = 2      # prefill micro-batches in flight per pipeline stage (launch_prefills_ahead)


class TDPipeScheduler(BatchingScheduler):
    # an empty prefill batch would end the prefill phase (Algorithm 1): no waiting for a prefix
    wait_for_shared_prefix = False
    swaps_preempted = True      # brought back by _bring_back_swapped

    def __init__(self, block_manager: BlockManager, params: TDPipeParams, max_model_len: int,
                 depth: int):
        super().__init__(block_manager, params.max_num_seqs, params.max_num_batched_tokens,
                         max_model_len)
        self.params = params
        self.depth = max(depth, 1)
        self.points = future_points(params.future_point_interval, params.future_point_horizon)
        # the forecast counts the pool's tokens over every block table of a sequence (one, or
        # one per KV layer group: a windowed table holds its window, a global one the context)
        self.pool_tokens = block_manager.num_blocks * block_manager.block_size
        self.capacity = self.pool_tokens * params.kv_safety_ratio
        self.step_times: Optional[StepTimes] = None
        self.phase = "prefill"
        self.stealing: WorkStealing[Sequence] = WorkStealing(self.depth, params.work_stealing)
        self._forecast: Optional[KVForecast] = None      # this prefill phase's Algorithm 1 map
        self._held_for_peak = False    # admit_within_capacity refused the queue's head
        self._decode_forecast: Optional[KVForecast] = None
        self._returned: deque[tuple[list[Sequence], int]] = deque()
        self._decode_launched = 0
        self._phase_entered = 0
        self._phase_finished = 0
        self._decisions: list[dict] = []
        self.num_switches = 0
        self.predicted_kv_usage: Optional[float] = None  # of the current decode step, 0..1

    # --- predictions ----------------------------------------------------------------------------
    def predicted_remaining(self, seq: Sequence) -> int:
        """Output tokens `seq` is predicted to generate from now on: the predictor's length (else
        max_tokens; its upper forecast when the predictor is unsure, `unsure_upper_forecast`)
        minus what it generated, capped by max_tokens and max_model_len. A request
        already past its prediction still holds its KV, and the forecast was wrong about it:
        with `overdue_doubling` it is expected to run as long again as it has so far (a reply
        that outlived its forecast tends to run long: on replies stopping at EOS under a
        1,024-token cap one interval at a time let the cache overcommit into preemptions), else
        one more future-point interval; never past its cap."""
        request = seq.request
        generated = len(seq.output_token_ids)
        limit = self.max_model_len - seq.prompt_len
        if request.sampling.max_tokens is not None:
            limit = min(limit, request.sampling.max_tokens)
        predicted = forecast_length(request, self.params)
        predicted = limit if predicted is None else min(predicted, limit)
        left = predicted - generated
        if left <= 0:
            interval = self.params.future_point_interval
            more = max(generated, interval) if self.params.overdue_doubling else interval
            left = min(more, limit - generated)
        return max(left, 0)

    def _running_forecast(self, swapped: bool = True) -> KVForecast:
        """Algorithm 1's map of the running requests (and the swapped ones: they come back)."""
        forecast = KVForecast(self.points, self.capacity, self.block_manager.block_size,
                              self.params.count_ending_requests,
                              self.block_manager.table_windows)
        for seq in [*self.running, *(self.swapped if swapped else ())]:
            forecast.update(seq.num_tokens, self.predicted_remaining(seq))
        return forecast

    def _bring_back_swapped(self) -> list[Sequence]:
        """memory.preemption_mode swap: swapped requests come back, oldest first, while the
        device has room and (greedy_prefill) Algorithm 1's forecast of the running requests
        with it stays within the capacity; with nothing running the oldest always does."""
        if not self.swapped:
            return []
        forecast = self._running_forecast(swapped=False) if self.params.greedy_prefill else None

        def admits(seq: Sequence) -> bool:
            if forecast is None:
                return True
            predicted = self.predicted_remaining(seq)
            if not forecast.fits(seq.num_tokens, predicted):
                return False
            forecast.update(seq.num_tokens, predicted)
            return True

        return self._swap_in(admits)

    def _prefill_done(self) -> bool:
        """Algorithm 1's CheckSwitch (or the occupancy-ratio ablation)."""
        if self.params.greedy_prefill:
            return self._held_for_peak or self._forecast.should_switch()
        return self.block_manager.usage() >= self.params.kv_occupancy_ratio

    def _holds_back(self, forecast: KVForecast, seq: Sequence, predicted: int,
                    admitted_before: bool) -> bool:
        """admit_within_capacity: `seq` waits if, with others running (or admitted before it),
        its forecast would take the predicted peak over the capacity."""
        return (self.params.greedy_prefill and self._within_capacity()
                and admitted_before and not forecast.fits(seq.num_tokens, predicted))

    def _within_capacity(self) -> bool:
        """admit_within_capacity now: `auto` holds prompts back once the job has preempted."""
        mode = self.params.admit_within_capacity
        return self.num_preemptions > 0 if mode == "auto" else mode

    def _admit(self, seq: Sequence, num_tokens: int) -> bool:
        """In a prefill phase each admitted request goes into Algorithm 1's map as it is
        admitted (UpdateUsage; the map is a sum, so this equals updating after the launch), and
        with admit_within_capacity one that would overflow it is held back."""
        if self.phase != "prefill" or self._forecast is None:
            return super()._admit(seq, num_tokens)
        predicted = self.predicted_remaining(seq)
        if self._holds_back(self._forecast, seq, predicted, bool(self.running)):
            self._held_for_peak = True
            return False
        if not super()._admit(seq, num_tokens):
            return False
        self._forecast.update(seq.num_tokens, predicted)
        return True

    # --- the Scheduler protocol -------------------------------------------------------------------
    def in_flight_limit(self, depth: int) -> int:
        """§3.2.1: "for the prefill phase, the engine packs prompts and directly sends them to
        workers until the switching condition is triggered". Here up to PREFILL_AHEAD x PP: each
        worker has its next plan queued behind the one it runs, and the plans waiting on a
        worker's pipe stay bounded."""
        if self.phase == "prefill" and self.params.launch_prefills_ahead and depth > 1:
            return PREFILL_AHEAD * depth
        return depth

    def schedule(self) -> list[MicroBatch]:
        if self.phase == "prefill":
            batch = self._prefill_batch()
            if batch is not None:
                return [batch]
        if self.phase == "decode":
            batch = self._decode_batch()
            if batch is not None:
                return [batch]
        return []

    def on_result(self, batch: MicroBatch) -> None:
        finished = sum(1 for item in batch.items if item.seq.is_finished)
        alive = [item.seq for item in batch.items
                 if item.seq.status is SequenceStatus.RUNNING and not item.seq.is_prefill]
        super().on_result(batch)
        if self.phase != "decode":
            return
        self._phase_finished += finished
        if batch.phase == "decode":
            self._returned.append((alive, finished))
        else:   # a prefill launched before the switch: its requests join the decode phase
            self.stealing.pool.extend(alive)

    def abort_all(self) -> list[Sequence]:
        self._returned.clear()
        self.stealing.reset()
        self.phase, self._forecast, self._decode_forecast = "prefill", None, None
        self.predicted_kv_usage = None
        return super().abort_all()

    def drain_decisions(self) -> list[dict]:
        out, self._decisions = self._decisions, []
        return out

    def step_stats(self) -> dict:
        """The KV usage the length predictor forecast for this decode step (paper §3.3)."""
        if self.predicted_kv_usage is None:
            return {}
        return {"kv_predicted": round(self.predicted_kv_usage, 4)}

    # --- prefill phase ----------------------------------------------------------------------------
    def _prefill_batch(self) -> Optional[MicroBatch]:
        self._bring_back_swapped()
        if self.swapped:        # they come first: no new prompt while one waits for room
            if self.running:
                self._switch("decode", "swapped requests wait for KV")
            return None
        if not self.waiting:
            if self.running:
                self._switch("decode", "nothing waiting")
            return None
        if self._forecast is None:
            self._forecast = self._running_forecast()
        self._held_for_peak = False
        batch = self._whole_prompts()       # _admit updates the forecast
        if not batch.items:
            if self.running:
                full = len(self.running) >= self.max_num_seqs
                reason = ("predicted KV peak exceeds capacity" if self._held_for_peak else
                          "max_num_seqs reached" if full else "KV cache full")
                self._switch("decode", reason)
            return None
        if self._prefill_done():
            reason = ("predicted KV peak exceeds capacity" if self.params.greedy_prefill
                      else "KV occupancy ratio reached")
            self._switch("decode", reason)
        return batch

    # --- decode phase -----------------------------------------------------------------------------
    def _decode_batch(self) -> Optional[MicroBatch]:
        tried_prefill = False
        while True:
            returned = bool(self._returned)
            members, finished = self._returned.popleft() if returned else ([], 0)
            members = [s for s in members if s.status is SequenceStatus.RUNNING]
            self.stealing.pool = [s for s in self.stealing.pool
                                  if s.status is SequenceStatus.RUNNING and not s.in_flight]
            if not returned and not self.stealing.pool:
                back = self._bring_back_swapped()
                if back:        # nothing else to decode: the swapped requests, oldest first
                    self.stealing.pool.extend(back)
                    continue
                if self.waiting and not self.running:
                    self._switch("prefill", "every request of the decode phase finished")
                    return self._prefill_batch()
                return None
            # a returned batch always passes through the window, even emptied by finishes
            chosen = self.stealing.next_batch(members, finished)
            if not chosen:
                continue
            if not tried_prefill and self.waiting and self._decode_done(len(chosen)):
                batch = self._prefill_batch()
                if batch is not None:
                    return batch
                # nothing could be admitted after all (the phase is decode again): go on decoding
                tried_prefill = True
                continue
            preemptions_before = self.num_preemptions
            batch = self._reserve_decode(chosen)
            if self.swapped and self.num_preemptions == preemptions_before:
                # as vLLM: swapped requests come back only after a launch that preempted none;
                # they join the pool for the next batches
                self.stealing.pool.extend(self._bring_back_swapped())
            if batch.items:
                self._decode_launched += 1
                self._track_prediction()
                return batch

    def _preempt(self, seq: Sequence) -> None:
        """Also out of the work-stealing pool and the returned batches waiting to be reused: a
        swapped request brought back later must not be found there a second time."""
        super()._preempt(seq)
        self.stealing.pool = [s for s in self.stealing.pool if s is not seq]
        for members, _ in self._returned:
            members[:] = [s for s in members if s is not seq]

    def _reserve_decode(self, chosen: list[Sequence]) -> MicroBatch:
        """One more KV slot for each chosen request. When the cache is full, the newest idle
        request outside the batch is preempted (recomputed in a later prefill phase), then the
        batch's own last unreserved member, then the request itself: nothing already reserved
        is ever evicted."""
        batch = MicroBatch(phase="decode")
        order = [s for s in chosen if s.status is SequenceStatus.RUNNING]
        inside = {id(s) for s in order}
        others = [s for s in self.running if not s.in_flight and id(s) not in inside]
        tail = len(order) - 1
        for index, seq in enumerate(order):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            target = seq.num_computed_tokens + 1
            while not self.block_manager.can_grow(seq.request_id, target):
                while tail > index and order[tail].status is not SequenceStatus.RUNNING:
                    tail -= 1
                if others:
                    self._preempt(others.pop())
                elif tail > index:
                    self._preempt(order[tail])
                    tail -= 1
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.grow(seq.request_id, target)
                batch.items.append(ScheduledSeq(seq, 1))
        return batch

    def _decode_done(self, batch_size: int) -> bool:
        """Approach 3 (or the finished-ratio ablation): switch to prefill now? Records why."""
        if not self.params.intensity_switch:
            ratio = self._phase_finished / max(self._phase_entered, 1)
            if ratio >= self.params.finished_ratio and self._next_prefill_cycle():
                self._switch("prefill", "finished ratio reached", finished_ratio=round(ratio, 4))
                return True
            return False
        if self.step_times is None:
            raise RuntimeError("tdpipe: the step-time table was not set (TDPipeParams.prepare)")
        pending = self._next_prefill_cycle()
        if not pending:
            return False
        batches = pack_prefill(pending, self.max_num_batched_tokens)
        x = intensities(self.step_times, batch_size, batches, self.depth)
        if x.switch:
            self._switch("prefill", "spatial < temporal intensity",
                         spatial=round(x.spatial, 4), temporal=round(x.temporal, 4),
                         bubble_s=round(x.bubble_s, 4), total_s=round(x.total_s, 4),
                         decode_batch_size=batch_size, pending_prefills=len(pending),
                         prefill_batches=len(batches))
            return True
        return False

    def _next_prefill_cycle(self) -> list[int]:
        """Prompt lengths the next prefill phase would take if it started now: the waiting
        requests that fit in the free KV, up to the point Algorithm 1 would switch back."""
        if self.swapped:
            return []      # swapped requests come back first (_prefill_batch)
        forecast = self._running_forecast() if self.params.greedy_prefill else None
        if forecast is not None and forecast.should_switch():
            return []      # the running requests alone are predicted to fill the cache
        # as _admit: while requests run, the watermark stays free for their decodes
        free = self.block_manager.num_free_blocks - (
            self.block_manager.watermark_blocks if self.running else 0)
        block = self.block_manager.block_size
        room = self.max_num_seqs - len(self.running)
        used = self.block_manager.num_blocks - free
        lengths: list[int] = []
        for seq in self.waiting:
            need = -(-seq.num_uncomputed_tokens // block) * self.block_manager.num_groups
            if need > free or len(lengths) >= room:
                break
            if forecast is not None:
                predicted = self.predicted_remaining(seq)
                if self._holds_back(forecast, seq, predicted, bool(self.running or lengths)):
                    break
            free -= need
            used += need
            lengths.append(seq.num_uncomputed_tokens)
            if forecast is not None:
                forecast.update(seq.num_tokens, predicted)
                if forecast.should_switch():
                    break
            elif used / self.block_manager.num_blocks >= self.params.kv_occupancy_ratio:
                break
        return lengths

    def _track_prediction(self) -> None:
        if self._decode_forecast is None:
            self.predicted_kv_usage = None
            return
        step = self._decode_launched // self.depth
        self.predicted_kv_usage = min(self._decode_forecast.at_step(step) / self.pool_tokens, 2.0)

    # --- phase switches ---------------------------------------------------------------------------
    def _switch(self, to: str, reason: str, **inputs) -> None:
        record = {"switch": f"{self.phase}->{to}", "reason": reason,
                  "kv_usage": round(self.block_manager.usage(), 4),
                  "running": len(self.running), "waiting": len(self.waiting), **inputs}
        if to == "decode":
            forecast = self._forecast or self._running_forecast()
            record["predicted_kv_peak"] = round(forecast.peak() / self.pool_tokens, 4)
            self._decode_forecast = forecast
            self._forecast = None
            self.stealing.reset()
            self.stealing.pool = [s for s in self.running if not s.in_flight
                                  and s.num_computed_tokens > 0 and not s.is_prefill]
            self._returned.clear()
            self._decode_launched = 0
            self._phase_entered = len(self.running)     # in-flight ones too: they finish here
            self._phase_finished = 0
        else:
            self._forecast = None
            self._returned.clear()
            self.predicted_kv_usage = None
        self.phase = to
        self.num_switches += 1
        if len(self._decisions) < 10_000:      # drained by the engine after every micro-batch
            self._decisions.append(record)
        log.debug("tdpipe: %s", record)
