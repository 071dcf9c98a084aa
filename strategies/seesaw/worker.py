"""Seesaw's side of a worker process: two layouts over the same ranks, switched on command.

The worker's partition and KV cache come from resharding.worker_layouts.LayoutSwitcher (host
weights, one KV buffer viewed per layout); "swap" messages go to its prefetcher (KV copies with
the CPU store) and "reshard" switches the layout after the plans sent before it have run. One
rank samples in every layout: the sampler keeps per-request state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from batchinfer.engine.runtime.worker_extension import WorkerExtension
from batchinfer.resharding.worker_layouts import LayoutSpec, LayoutSwitcher


def host_bytes(arch, layouts: list, world_size: int, dummy: bool,
               store_bytes: int = 0) -> tuple[int, str]:
    """(bytes, what) Seesaw holds in host memory beside the model: every rank's host copy of
    the weights (whole fp32 tensors of what any of its layouts reads) and, where `store_bytes`,
    the CPU KV store. build.py checks both before the store is allocated; the check before the
    workers start counts the copies alone (the allocated store already shows in the host's
    available memory)."""
    from batchinfer.resharding.weights import host_copy_bytes

    copies = sum(host_copy_bytes(arch, [lay.info(rank).partition for lay in layouts], dummy)
                 for rank in range(world_size))
    what = "Seesaw's host copies of the weights (whole fp32 tensors, one per rank)"
    if store_bytes:
        what += " and its CPU KV store (cpu_kv_cache_memory)"
    return copies + store_bytes, what


@dataclass
class SeesawWorker(WorkerExtension):
    spec: LayoutSpec

    def extra_layouts(self) -> list:
        return list(self.spec.layouts.values())

    def host_weight_bytes(self, arch, world_size: int, dummy: bool) -> tuple[int, str]:
        return host_bytes(arch, list(self.spec.layouts.values()), world_size, dummy)

    def roles(self, worker) -> None:
        worker.samples = worker.is_last and worker.spec.rank == self.spec.sampling_rank

    def build_partition(self, worker, arch) -> bool:
        rank = worker.spec.rank
        self.switcher = LayoutSwitcher(
            worker, self.spec, arch, lambda transfer_ids, seconds, thread:
            worker.send(("swapped", rank, transfer_ids, seconds, thread)))
        self._enter(worker, self.spec.initial)
        return True

    def _enter(self, worker, name: str) -> None:
        layout, worker.model, worker.kv_caches = self.switcher.enter(name)
        worker.use_fused_ops()
        worker.set_roles(layout)

    def message(self, worker, message: tuple, pending) -> bool:
        if message[0] == "swap":
            self.switcher.prefetcher.submit(*message[1:])
            return True
        if message[0] != "reshard":
            return False
        while pending:       # plans sent before the switch run in the old layout
            worker.execute(*pending.popleft())
        worker.finish_sends()
        t0 = time.time()
        self._enter(worker, message[1])
        worker.open_channels()
        worker.event("reshard", -1, t0, layout=message[1],
                     bytes_from_host=self.switcher.last_stats.bytes_from_host)
        worker.flush_events(force=True)
        return True

    def close(self, worker) -> None:
        self.switcher.prefetcher.close()
