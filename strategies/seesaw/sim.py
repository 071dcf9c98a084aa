"""Seesaw in the simulator: its real scheduler (strategies/seesaw/scheduler.py) over the two-tier
block managers, on an executor that switches between two simulated pipelines.

- Each layout (prefill c_p, decode c_d) is a SimulatedExecutor over the same ranks; micro-batches
  run on the current one.
- `Reshard`: every rank reloads its new weight shard from host memory (the paper §4.1:
  weights / ranks over the host link); no stage of the new layout starts before that is done.
- `Transfer` (a sequence's KV to or from the CPU store): each rank copies its shard over its host
  link, all ranks in parallel. With `async_pipeline` the copies run on their own channel, one
  after another, beside the compute (the prefetcher thread); without it they occupy the ranks
  between micro-batches.
The KV sizing is strategies/seesaw/build.py's (`tier_blocks`).
"""
from __future__ import annotations

from typing import Optional

from batchinfer.engine.build import kv_element_bytes
from batchinfer.engine.engine import Replica
from batchinfer.engine.executor import Executor
from batchinfer.engine.runtime.build import per_rank_kv_budget
from batchinfer.engine.runtime.layout import ParallelLayout
from .executor import Reshard
from batchinfer.resharding.kv_tiers import Transfer
from .scheduler import PREFILL

from batchinfer.sim.cost_model import cost_device
from batchinfer.sim.executor import SimulatedExecutor, VirtualClock

_EPS = 1e-12


class SimulatedSeesawExecutor(Executor):
    def __init__(self, clock: VirtualClock, cost, layouts: dict[str, ParallelLayout],
                 threads: int, weight_bytes: int, block_bytes_per_table: tuple[int, ...],
                 async_copies: bool):
        """block_bytes_per_table: the bytes a copy moves per block of each table, all ranks'
        shards (every layer; with KV layer groups the table's group's layers): a copy moves
        the blocks it pairs."""
        self.clock, self.cost = clock, cost
        self.layouts = layouts
        self.pipelines = {name: SimulatedExecutor(clock, cost, list(lay.layers_per_stage),
                                                  lay.tp, threads, register=False)
                          for name, lay in layouts.items()}
        self.current = PREFILL
        self.world = layouts[PREFILL].world_size
        self.weight_bytes, self.block_bytes_per_table = weight_bytes, block_bytes_per_table
        self.async_copies = async_copies
        self._copy_free_at = 0.0
        self._copies: dict[int, float] = {}            # transfer id -> done at
        self.num_reshards = 0
        self.reshard_seconds = 0.0
        self.copy_seconds = 0.0
        clock.executors.append(self)

    @property
    def pipeline(self) -> SimulatedExecutor:
        return self.pipelines[self.current]

    # --- the Executor protocol ---------------------------------------------------------------
    @property
    def max_in_flight(self) -> int:
        return self.pipeline.max_in_flight

    @property
    def num_in_flight(self) -> int:
        return self.pipeline.num_in_flight

    @property
    def next_completion(self) -> Optional[float]:
        times = [t for t in [self.pipeline.next_completion, *self._copies.values()]
                 if t is not None]
        return min(times) if times else None

    def submit(self, batch) -> None:
        self.pipeline.submit(batch)

    def ready(self) -> bool:
        return self.pipeline.ready()

    def wait(self) -> None:
        self.clock.advance_to_next_event()

    def collect(self):
        return self.pipeline.collect()

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def close(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.close()

    # --- actions and copies (the engine's optional capabilities) --------------------------------
    def run_actions(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Reshard):
                self._reshard(action.name)
            elif isinstance(action, Transfer):
                self._copy(action)
            else:
                raise TypeError(f"unknown executor action {action!r}")

    def _reshard(self, name: str) -> None:
        if self.num_in_flight or self._copies:
            raise RuntimeError("re-shard requested with micro-batches or copies in flight")
        same = self.layouts[name] == self.layouts[self.current]
        self.current = name
        if same:
            return
        seconds = self.cost.host_copy_seconds(self.weight_bytes / self.world)
        self.pipeline.hold_stages_until(self.clock.now + seconds)
        self.num_reshards += 1
        self.reshard_seconds += seconds

    def _copy(self, transfer: Transfer) -> None:
        per_table = transfer.table_blocks or (len(transfer.store_blocks),)
        seconds = self.cost.host_copy_seconds(
            sum(n * b for n, b in zip(per_table, self.block_bytes_per_table)) / self.world)
        self.copy_seconds += seconds
        if self.async_copies:
            start = max(self.clock.now, self._copy_free_at)
            self._copy_free_at = start + seconds
            self._copies[transfer.transfer_id] = start + seconds
        else:            # on the ranks' main threads, after what they already have queued
            start = max(self.pipeline.busy_until, self.clock.now)
            self.pipeline.hold_stages_until(start + seconds)
            self._copies[transfer.transfer_id] = start + seconds

    @property
    def num_pending_transfers(self) -> int:
        return len(self._copies)

    def transfers_ready(self) -> bool:
        return any(t <= self.clock.now + _EPS for t in self._copies.values())

    def take_done_transfers(self) -> list[int]:
        done = [tid for tid, t in self._copies.items() if t <= self.clock.now + _EPS]
        for tid in done:
            del self._copies[tid]
        return done

    # --- observability ---------------------------------------------------------------------------
    def reset_timeline(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.reset_timeline()

    def stage_summary(self) -> Optional[dict]:
        """Per rank: busy time in either layout over the whole window (rank r is stage r // tp
        of each layout)."""
        parts = {name: p.stage_summary() for name, p in self.pipelines.items()}
        windows = [p.window for p in self.pipelines.values() if p.window is not None]
        if not windows:
            return None
        span = max(w[1] for w in windows) - min(w[0] for w in windows)
        stages = []
        for rank in range(self.world):
            busy = sum(part["stages"][rank // self.layouts[name].tp]["busy_s"]
                       for name, part in parts.items() if part is not None)
            stages.append({"stage": rank, "busy_s": busy,
                           "bubble_ratio": 1.0 - busy / span if span > 0 else None})
        return {"window_s": span, "stages": stages}

    def strategy_summary(self) -> dict:
        return {"num_reshards": self.num_reshards,
                "reshard_seconds": round(self.reshard_seconds, 4),
                "copy_seconds": round(self.copy_seconds, 4)}


def seesaw_replica(config, params, arch, cost, clock: VirtualClock, dtype_bytes: int,
                   max_model_len: int, threads: int) -> Replica:
    """The replica, sized and checked as strategies/seesaw/build.py does."""
    from .build import (copy_bytes_per_table, resolve_layouts, seesaw_groups, seesaw_scheduler,
                        tier_blocks)

    layouts = resolve_layouts(config, params, arch)
    prefill = layouts[PREFILL]
    block_size = config.cache.block_size
    per_rank = per_rank_kv_budget(config, prefill, arch, cost_device(cost), dtype_bytes,
                                  cost.memory_bytes)
    kv_bytes = kv_element_bytes(config, dtype_bytes)
    groups = seesaw_groups(config, arch, layouts, max_model_len)
    num_blocks, _, store_blocks = tier_blocks(config, params, arch, layouts, per_rank,
                                              kv_bytes, max_model_len, groups)
    scheduler = seesaw_scheduler(config, params, arch, layouts, groups, num_blocks, store_blocks,
                                 max_model_len)
    executor = SimulatedSeesawExecutor(clock, cost, layouts, threads,
                                       arch.num_params() * dtype_bytes,
                                       copy_bytes_per_table(arch, block_size, kv_bytes, groups),
                                       params.async_pipeline)
    return Replica(scheduler, executor)

