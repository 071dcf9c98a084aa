"""vLLM's pipeline-parallel baseline: `pp` independent baseline schedulers ("virtual engines")
over one block manager, their micro-batches taking turns in the pipeline."""
from __future__ import annotations

from .request import Sequence
from .scheduler import BatchingScheduler, MicroBatch, Scheduler


class VirtualEngines(Scheduler):
    """Pipeline-parallel baseline as vLLM runs it: `pp` independent schedulers ("virtual engines")
    over one block manager. A new request joins the one with the fewest unfinished sequences;
    micro-batches come from them in turn, each only when its previous micro-batch is back, so
    up to `pp` balanced micro-batches are in flight."""

    def __init__(self, engines: list[BatchingScheduler]):
        self.engines = engines
        self.block_manager = engines[0].block_manager
        for engine in engines:      # one pool: no new prompt while any waits in the swap area
            engine.pool_sharers = self
        self.max_num_batched_tokens = engines[0].max_num_batched_tokens
        self._busy = [False] * len(engines)
        self._owner: dict[int, int] = {}
        self._next = 0

    def add(self, seq: Sequence) -> None:
        self._least_loaded().add(seq)

    def add_next(self, seq: Sequence) -> None:
        self._least_loaded().add_next(seq)     # one block manager: any engine can fork

    def _least_loaded(self) -> BatchingScheduler:
        return min(self.engines, key=lambda e: e.num_waiting + e.num_running)

    def schedule(self) -> list[MicroBatch]:
        n = len(self.engines)
        for offset in range(n):
            index = (self._next + offset) % n
            if self._busy[index]:
                continue
            batches = self.engines[index].schedule()
            if batches:
                self._next = (index + 1) % n
                self._busy[index] = True
                for batch in batches:
                    self._owner[id(batch)] = index
                return batches
        return []

    def on_result(self, batch: MicroBatch) -> None:
        index = self._owner.pop(id(batch))
        self._busy[index] = False
        self.engines[index].on_result(batch)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def abort_all(self) -> list[Sequence]:
        self._busy = [False] * len(self.engines)
        self._owner.clear()
        return [seq for e in self.engines for seq in e.abort_all()]

    @property
    def num_preemptions(self) -> int:
        return sum(e.num_preemptions for e in self.engines)

    @property
    def swaps_preempted(self) -> bool:
        return all(e.swaps_preempted for e in self.engines)

    @property
    def num_swapped(self) -> int:
        return sum(e.num_swapped for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(e.num_waiting_tokens for e in self.engines)

    @property
    def feed_tokens(self) -> int:
        return self.engines[0].feed_tokens
