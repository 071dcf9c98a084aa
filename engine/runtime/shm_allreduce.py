"""Tensor-parallel all-reduce through shared memory, for the ranks of one CPU host.

gloo's all-reduce goes through loopback TCP: 0.6-2 ms per call for a decode step's [rows, hidden]
tensor on a 2-core host (benchmarks/engine/allreduce_cost.py), twice per layer, so TP decode lost to
every other layout. vLLM's CPU backend all-reduces through shared memory for the same reason.
Here the controller allocates one buffer per TP group (torch shares it with the workers by file
descriptor: no name to collide on) and the ranks sum through it (kernels/shm_allreduce.cpp);
process groups, barriers and every other collective stay torch.distributed's. Switch:
`parallel.tp_all_reduce: gloo`. On CUDA, NCCL all-reduces as before (gloo over host copies with
`parallel.gpu_transport: host`, transport.py).
"""
from __future__ import annotations

from typing import Iterable

import torch

SLOT_FLOATS = 1 << 20   # 4 MiB per rank per set: larger tensors go through in chunks
COUNTER_FLOATS = 16     # one int64 counter per 64-byte line (kernels/shm_allreduce.cpp)


def resolve_mode(device: str, requested: str, staged: bool = False) -> str:
    """What TP all-reduces go through: nccl on CUDA (gloo over host copies with
    gpu_transport: host); on CPU `requested` (shm or gloo), gloo where the native kernels did
    not build."""
    from ..kernels import load_native_kernels

    if device != "cpu":
        return "gloo" if staged else "nccl"
    return "shm" if requested == "shm" and load_native_kernels() else "gloo"


def group_buffers(layouts: Iterable, device: str, requested: str) -> dict[tuple[int, ...], torch.Tensor]:
    """One shared buffer per tensor-parallel group of `layouts` (ParallelLayouts: a run's, and
    any a strategy's extension switches to); empty where the shared-memory path does not apply."""
    if resolve_mode(device, requested) != "shm":
        return {}
    import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

    buffers: dict[tuple[int, ...], torch.Tensor] = {}
    for layout in layouts:
        if layout.tp < 2:
            continue
        for ranks in layout.tp_groups():
            key = tuple(ranks)
            if key not in buffers:
                world = len(ranks)
                size = world * COUNTER_FLOATS + 2 * world * SLOT_FLOATS
                buffers[key] = torch.zeros(size, dtype=torch.float32).share_memory_()
    return buffers


class ShmAllReduce:
    """The calling rank's end of one group's buffer. Every rank of the group must make the same
    calls in the same order (as with any collective); `generation` counts them."""

    def __init__(self, buffer: torch.Tensor, rank: int, world: int, timeout_s: float):
        from ..kernels import load_native_kernels

        if not load_native_kernels():   # built by the controller already: this loads the cache
            raise RuntimeError("the shared-memory all-reduce needs the native CPU kernels")
        self.buffer, self.rank, self.world, self.timeout_s = buffer, rank, world, timeout_s
        self.generation = 0

    @staticmethod
    def accepts(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the group in place; every rank gets the same bits."""
        self.generation = torch.ops.batchinfer.shm_all_reduce_(
            t, self.buffer, self.rank, self.world, self.generation, self.timeout_s)
        return t


def tensor_parallel_group(group, ranks: list[int], spec):
    """The calling worker's TensorParallelGroup over `group` (ranks: its global ranks), with the
    shared-memory all-reduce where the controller gave the group a buffer (spec: its WorkerSpec)."""
    from ..model.shard import TensorParallelGroup

    buffer = spec.tp_buffers.get(tuple(ranks))
    shm = (ShmAllReduce(buffer, ranks.index(spec.rank), len(ranks), spec.timeout_s)
           if buffer is not None else None)
    return TensorParallelGroup(group, shm)
