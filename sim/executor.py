"""The simulated Executor: the engine's Executor seam over a virtual clock and a cost model.

Each replica's pipeline is `pp` stages; a stage runs one micro-batch at a time, in submission
order. A micro-batch submitted at virtual time t (after the controller's own work for the step,
which advances the clock) enters stage 0 when the stage is free, each later stage when the
previous one finished and the activations arrived (`transfer_seconds`) and the stage is free;
it completes when the last stage (LM head and sampler included) is done. The engine waits by
advancing the shared clock to the next completion of any replica, so data-parallel replicas run
side by side in virtual time. Sampled tokens are a filler id: simulated requests stop on their
length (max_tokens with ignore_eos), which is all the schedulers look at.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from batchinfer.engine.executor import Executor, StepResult
from batchinfer.engine.scheduler import MicroBatch

from .cost_model import BatchShape, CostModel

FILLER_TOKEN = 1
_EPS = 1e-12


class VirtualClock:
    """Simulated seconds; the executors registered on it say when their next event is."""

    def __init__(self) -> None:
        self.now = 0.0
        self.executors: list["SimulatedExecutor"] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)

    def advance_to_next_event(self) -> None:
        events = [e.next_completion for e in self.executors if e.next_completion is not None]
        if not events:
            raise RuntimeError("the simulated engine waits, but nothing is in flight")
        self.now = max(self.now, min(events))


@dataclass
class _InFlight:
    batch: MicroBatch
    mb_id: int
    done_at: float
    forward_s: float
    sample_s: float


class SimulatedExecutor(Executor):
    def __init__(self, clock: VirtualClock, cost: CostModel, layers_per_stage: list[int],
                 tp: int = 1, threads: int = 1, replica: int = 0, register: bool = True,
                 cpu_samplers: int = 0, structure_aware: bool = True, token_safe: bool = False,
                 sampler_threads: int = 1, split_samples: bool = False,
                 launch_ahead: bool = False, swap=None, swap_block_bytes: float = 0.0):
        """register: on the clock (False for a pipeline another executor wraps, which
        reports its events for it). Every stage prepares its inputs (cost.input_prep_seconds)
        before its forward on the rank's thread. CPU sampling (arXiv:2506.22033): `cpu_samplers` > 0 samples
        on that many CPU sampler lanes of `sampler_threads` cores each after the last stage's LM
        head, beside the next micro-batches' forwards: micro-batch n on lane n mod p, or with
        `split_samples` its rows split as evenly as they go over every lane (the pool's);
        `structure_aware` False sends each hand-off's metadata first (two more messages) and
        blocks the sender until the receiver takes it; `token_safe` prepares each stage's inputs
        on a thread of its own, as the engine's worker does (engine/runtime/worker.py,
        input_prep.py): the plan reaches that thread when the worker next reads its pipe (at
        once if it is between micro-batches, else when the micro-batch it is executing ends),
        and preparation starts once the previous micro-batch's forward has taken its inputs
        (one iteration ahead: CI == GI); the forward waits only for what is left of it.
        `launch_ahead` (the engine's async scheduling, engine/steps_ahead.py: one process, a
        GPU): the controller plans and launches a step while the previous one runs, so its
        work delays a step only by what outlasts the step before it. `swap` (the replica's
        kv_swap.SwapSpace, memory.preemption_mode swap): the KV copies decided since the last
        micro-batch ride on this one, each stage copying its layers' (and TP share's) part of
        `swap_block_bytes` per block over the host copy bandwidth before its forward, as the
        workers do."""
        self.clock, self.cost = clock, cost
        self.layers_per_stage = list(layers_per_stage)
        self.tp, self.threads, self.replica = tp, threads, replica
        self.pp = len(self.layers_per_stage)
        self._free_at = [0.0] * self.pp
        self._busy = [0.0] * self.pp
        self._micro_batches = [0] * self.pp
        self._window: Optional[list[float]] = None
        self._in_flight: deque[_InFlight] = deque()
        self._next_mb = 0
        self.cpu_samplers, self.structure_aware = cpu_samplers, structure_aware
        self._sampler_free_at = [0.0] * cpu_samplers
        self.token_safe, self.sampler_threads = token_safe, sampler_threads
        self.split_samples = split_samples
        self._prep_free_at = [0.0] * self.pp
        self._last_take = [0.0] * self.pp        # when the latest forward took its inputs
        # (begin, end) of each stage's latest micro-batches on the worker's main thread
        self._executing: list[deque[tuple[float, float]]] = [deque(maxlen=8)
                                                              for _ in range(self.pp)]
        self._last_done = 0.0
        self.launch_ahead = launch_ahead
        self.swap, self.swap_block_bytes = swap, swap_block_bytes
        self._model_layers = sum(self.layers_per_stage)
        self._host_free = 0.0           # when the controller finished launching the last step
        self.events: list[dict] = []
        self.record_events = True
        if register:
            clock.executors.append(self)

    # --- the Executor protocol -------------------------------------------------------------------
    @property
    def max_in_flight(self) -> int:
        return self.pp

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def next_completion(self) -> Optional[float]:
        return self._in_flight[0].done_at if self._in_flight else None

    def submit(self, batch: MicroBatch) -> None:
        shape = BatchShape.of(batch)
        controller = self.cost.controller_seconds(shape.seqs)
        if self.launch_ahead:      # planned while the step before ran: only the excess shows
            self.clock.advance(self._host_free + controller - self.clock.now)
        else:
            self.clock.advance(controller)
        t = planned = self._host_free = self.clock.now
        mb_id, self._next_mb = self._next_mb, self._next_mb + 1
        forward = sample = 0.0
        on_cpu = self.cpu_samplers > 0
        prep = self.cost.input_prep_seconds(shape)
        copied = len(self.swap.take_ops()) if self.swap is not None else 0
        for stage, layers in enumerate(self.layers_per_stage):
            last = stage == self.pp - 1
            if stage > 0:
                t += self.cost.transfer_seconds(shape.tokens)
                if not self.structure_aware:
                    t += 2 * self.cost.transfer_seconds(0)
            delivered = self._delivered(stage, planned)
            begins = max(delivered, self._free_at[stage])  # the worker starts on it
            start = max(t, self._free_at[stage])
            if stage > 0 and not self.structure_aware:      # the sender waits for the receiver
                self._free_at[stage - 1] = max(self._free_at[stage - 1], start)
            start = self._inputs_ready(stage, start, delivered, prep)
            seconds = self.cost.stage_seconds(shape, layers, last, self.tp, self.threads,
                                              sample=not on_cpu)
            if copied:      # the plan's KV swaps, before the forward
                seconds += self.cost.host_copy_seconds(
                    copied * self.swap_block_bytes * layers / self._model_layers / self.tp)
            end = start + seconds
            self._free_at[stage] = end
            self._executing[stage].append((begins, end))
            self._last_take[stage] = start
            self._busy[stage] += seconds
            self._micro_batches[stage] += 1
            forward += seconds
            if self.record_events:
                self.events.append({"replica": self.replica, "stage": stage, "rank": stage,
                                    "kind": "forward", "mb_id": mb_id, "start": start,
                                    "end": end})
            if self._window is None:
                self._window = [start, end]
            t = end
        if on_cpu and shape.sample_rows:
            t, sample = self._cpu_sample(mb_id, shape.sample_rows, t)
        t = self._last_done = max(t, self._last_done)        # results come back in order
        self._window[1] = max(self._window[1], t)
        self._in_flight.append(_InFlight(batch, mb_id, t, forward, sample))

    def _cpu_sample(self, mb_id: int, rows: int, logits_at: float) -> tuple[float, float]:
        """-> (when the micro-batch's tokens are sampled, the longest lane's sampling seconds)."""
        ready = logits_at + self.cost.host_copy_seconds(rows * self.cost.logits_bytes)
        lanes = self.cpu_samplers
        if self.split_samples:
            shares = [(lane, rows // lanes + (lane < rows % lanes)) for lane in range(lanes)]
        else:
            shares = [(mb_id % lanes, rows)]
        done, longest = ready, 0.0
        for lane, share in shares:
            if share:
                seconds = self.cost.cpu_sample_seconds(share, self.sampler_threads)
                end = max(ready, self._sampler_free_at[lane]) + seconds
                self._sampler_free_at[lane] = end
                done, longest = max(done, end), max(longest, seconds)
        return done, longest

    def _delivered(self, stage: int, planned: float) -> float:
        """When the stage's worker reads a plan sent at `planned`: then, or at the end of the
        micro-batch it is executing (it reads its pipe between micro-batches)."""
        for begins, ends in self._executing[stage]:
            if begins <= planned < ends:
                return ends
        return planned

    def _inputs_ready(self, stage: int, start: float, delivered: float, prep: float) -> float:
        """When `stage` can start a forward it could otherwise start at `start`."""
        if not self.token_safe:
            return start + prep                              # on the rank's thread, first
        ready = max(delivered, self._prep_free_at[stage], self._last_take[stage]) + prep
        self._prep_free_at[stage] = ready
        return max(start, ready)

    @property
    def window(self) -> Optional[tuple[float, float]]:
        """(first start, last completion) of the micro-batches so far."""
        return tuple(self._window) if self._window is not None else None

    @property
    def busy_until(self) -> float:
        """When the last stage with work queued is done with it."""
        return max(self._free_at)

    def hold_stages_until(self, t: float) -> None:
        """No stage starts a micro-batch before t (ranks busy with something else: a weight
        reload, a copy on their main thread); counted as busy time."""
        for stage in range(self.pp):
            start = max(self._free_at[stage], self.clock.now)
            if t > start:
                self._busy[stage] += t - start
                self._free_at[stage] = t

    def ready(self) -> bool:
        return bool(self._in_flight) and self._in_flight[0].done_at <= self.clock.now + _EPS

    def wait(self) -> None:
        self.clock.advance_to_next_event()

    def collect(self) -> tuple[MicroBatch, StepResult]:
        done = self._in_flight.popleft()
        tokens = [FILLER_TOKEN if item.samples else None for item in done.batch.items]
        return done.batch, StepResult(tokens, [None] * len(tokens), forward_s=done.forward_s,
                                      sample_s=done.sample_s)

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def close(self) -> None:
        self._in_flight.clear()

    # --- observability (the multi-process executor's names) -------------------------------------
    def reset_timeline(self) -> None:
        self._busy = [0.0] * self.pp
        self._micro_batches = [0] * self.pp
        self._window = None
        self.events.clear()

    def timeline(self, last: Optional[int] = None) -> list[dict]:
        return list(self.events[-last:] if last else self.events)

    def stage_summary(self) -> Optional[dict]:
        """Busy time and bubble ratio of each stage over this replica's window (first start to
        last completion)."""
        if self._window is None:
            return None
        span = self._window[1] - self._window[0]
        return {"window_s": span, "stages": [
            {"stage": s, "busy_s": self._busy[s], "micro_batches": self._micro_batches[s],
             "bubble_ratio": 1.0 - self._busy[s] / span if span > 0 else None}
            for s in range(self.pp)]}
