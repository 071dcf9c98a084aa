"""The controller's side of Seesaw's execution: the pipeline executor, plus layout switches and
KV copies between tiers.

Micro-batches go to the ranks as in any multi-process run; how many may be in flight follows
the current layout (its pipeline depth). A `Reshard` or a `Transfer` the scheduler decided is
sent to every rank of the replica on the same ordered pipe as the plans, so a rank applies it
after the micro-batches sent before it. A transfer is done when every rank has reported its copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from batchinfer.engine.runtime.executor import PipelineExecutor

from batchinfer.resharding.kv_tiers import Transfer


@dataclass(frozen=True)
class Reshard:
    """Switch every rank to layout `name` (nothing in flight, no copy pending)."""

    name: str


class SeesawExecutor(PipelineExecutor):
    def __init__(self, *args, layouts: dict, initial: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.layouts = layouts
        self.current = initial
        self.layout = layouts[initial]
        self._reports: dict[int, int] = {}     # transfer id -> ranks that reported it
        self._done: list[int] = []
        self.swap_seconds_by_rank: dict[int, float] = {}
        # worker thread name -> copies it ran (the prefetcher's, or MainThread without the
        # asynchronous pipeline): where the copies ran, as the report shows it
        self.copies_by_thread: dict[str, int] = {}
        self.num_reshards = 0
        self.seconds_by_layout: dict[str, float] = {name: 0.0 for name in layouts}
        self._since: Optional[float] = None      # the current layout's start (first submit)

    def submit(self, batch) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        super().submit(batch)

    def strategy_summary(self) -> dict:
        """Wall time in each layout (first micro-batch on), copy time per rank, re-shards, and
        which worker thread ran the KV copies (counted once per rank)."""
        seconds = dict(self.seconds_by_layout)
        if self._since is not None:
            seconds[self.current] += time.perf_counter() - self._since
        reshard = self.pool.stats.reshard_seconds()
        return {"seconds_by_layout": {k: round(v, 3) for k, v in seconds.items()},
                "num_reshards": self.num_reshards,
                "reshard_seconds_by_rank": {str(r): round(v, 3) for r, v in reshard.items()},
                "swap_seconds_by_rank": {str(r): round(v, 3)
                                         for r, v in sorted(self.swap_seconds_by_rank.items())},
                "kv_copies_by_thread": dict(sorted(self.copies_by_thread.items()))}

    @property
    def num_pending_transfers(self) -> int:
        return len(self._reports)

    def run_actions(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Reshard):
                if self.num_in_flight or self._reports:
                    raise RuntimeError("re-shard requested with micro-batches or copies in flight")
                if self._since is not None:
                    now = time.perf_counter()
                    self.seconds_by_layout[self.current] += now - self._since
                    self._since = now
                same = self.layouts[action.name] == self.layout
                self.current, self.layout = action.name, self.layouts[action.name]
                if same:     # c_p == c_d (the ablation without re-sharding): nothing to rebuild
                    continue
                self.num_reshards += 1
                message = ("reshard", action.name)
            elif isinstance(action, Transfer):
                self._reports[action.transfer_id] = 0
                message = ("swap", action.transfer_id, action.kind, action.device_blocks,
                           action.store_blocks, action.table_blocks)
            else:
                raise TypeError(f"unknown executor action {action!r}")
            for rank in self.ranks:
                self.pool.send(rank, message)

    def transfers_ready(self) -> bool:
        self._absorb()
        return bool(self._done)

    def take_done_transfers(self) -> list[int]:
        self._absorb()
        done, self._done = self._done, []
        return done

    def _absorb(self) -> None:
        reports, self.pool.swapped = self.pool.swapped, []
        for rank, ids, seconds, thread in reports:
            self.swap_seconds_by_rank[rank] = self.swap_seconds_by_rank.get(rank, 0.0) + seconds
            self.copies_by_thread[thread] = self.copies_by_thread.get(thread, 0) + len(ids)
            for tid in ids:
                self._reports[tid] += 1
                if self._reports[tid] == len(self.ranks):
                    del self._reports[tid]
                    self._done.append(tid)
