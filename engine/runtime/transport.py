"""How a worker's tensors reach the other ranks: torch.distributed as it is (gloo on CPU, NCCL on
CUDA with one GPU per rank), or, with `parallel.gpu_transport: host`, through host memory over
gloo, so several ranks can share one GPU.

NCCL refuses two ranks on one device, and the project's GPU machines lend one card: the staged
transport is how the multi-process runtime (PP, TP, DP, a strategy's re-sharding) runs and is
tested there. Every point-to-point message and collective of the runtime goes through the
functions below, so the NCCL path and the staged one differ only here: a CUDA tensor is copied to
pinned host memory (torch's caching host allocator) before gloo sends it, and a receive lands in a
host buffer that its `wait()` copies to the device tensor the caller posted. It is a test and
small-GPU configuration, not a fast one: each message crosses PCIe twice and gloo's loopback TCP.

`configure` is called once per worker process before any message (worker.Worker.setup).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..host_to_device import pinned_empty

_staged = False
_stage_cpu_tensors = False


def configure(staged: bool, stage_cpu_tensors: bool = False) -> None:
    """staged: CUDA tensors go through host memory over gloo. stage_cpu_tensors: CPU tensors are
    copied through a host buffer too (the tests' way to run the staged code on a CPU host)."""
    global _staged, _stage_cpu_tensors
    _staged, _stage_cpu_tensors = staged, staged and stage_cpu_tensors


def backend(device_type: str, staged: bool) -> str:
    """The process group's backend: NCCL only for CUDA ranks that each own a GPU."""
    return "nccl" if device_type == "cuda" and not staged else "gloo"


def _stages(t: torch.Tensor) -> bool:
    return _staged and (t.device.type != "cpu" or _stage_cpu_tensors)


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped as `t` (pinned when t is on a GPU)."""
    return pinned_empty(t.shape, t.dtype) if t.device.type != "cpu" else torch.empty_like(t)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in host memory; a synchronous copy, so gloo reads finished data."""
    return _host_buffer(t).copy_(t)


class _StagedWork:
    """A gloo work on a host buffer. `wait()` may be called again (gloo's own would block)."""

    def __init__(self, work, host: Optional[torch.Tensor]):
        self.work, self.host = work, host
        self.done = False

    def wait(self, *args):
        if self.done:
            return True
        result = self.work.wait(*args)
        if result is not False:
            self._arrived()
            self.done, self.host = True, None
        return result

    def _arrived(self) -> None:
        pass


class StagedSend(_StagedWork):
    """An isend of a host copy: keeps the copy alive until the message is out."""

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()


class StagedReceive(_StagedWork):
    """An irecv into a host buffer; `wait()` copies it into the tensor the caller posted (read that
    tensor only after wait, as with any irecv)."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        super().__init__(work, host)
        self.target = target

    def _arrived(self) -> None:
        self.target.copy_(self.host)

    def is_completed(self) -> bool:
        """Whether wait() has delivered the values (gloo's work alone says nothing before it)."""
        return self.done


def isend(t: torch.Tensor, dst: int, tag: int = 0, group=None):
    if not _stages(t):
        return dist.isend(t, dst=dst, tag=tag, group=group)
    host = _host_copy(t)
    return StagedSend(dist.isend(host, dst=dst, tag=tag, group=group), host)


def irecv(t: torch.Tensor, src: int, tag: int = 0, group=None):
    if not _stages(t):
        return dist.irecv(t, src=src, tag=tag, group=group)
    host = _host_buffer(t)
    return StagedReceive(dist.irecv(host, src=src, tag=tag, group=group), host, t)


def send(t: torch.Tensor, dst: int, tag: int = 0, group=None) -> None:
    dist.send(_host_copy(t) if _stages(t) else t, dst=dst, tag=tag, group=group)


def recv(t: torch.Tensor, src: int, tag: int = 0, group=None) -> None:
    if not _stages(t):
        dist.recv(t, src=src, tag=tag, group=group)
        return
    host = _host_buffer(t)
    dist.recv(host, src=src, tag=tag, group=group)
    t.copy_(host)


def all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sums `t` over `group` in place; returns t."""
    if not _stages(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    host = _host_copy(t)
    dist.all_reduce(host, op=dist.ReduceOp.SUM, group=group)
    t.copy_(host)
    return t


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on each), in group-rank order, on t's device."""
    size = dist.get_world_size(group)
    if not _stages(t):
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        return parts
    host = _host_copy(t)
    parts = [torch.empty_like(host) for _ in range(size)]
    dist.all_gather(parts, host, group=group)
    return [p.to(t.device) for p in parts]


def barrier(group=None) -> None:
    dist.barrier(group=group)


def describe(device_type: str, staged_transport: bool) -> Optional[str]:
    """report.json's `parallel.gpu_transport`: None on CPU, where gloo is the only transport (but
    in the tests' CPU mode of the staged one)."""
    if staged_transport:
        return "host (gloo through pinned host memory)"
    return "nccl" if device_type == "cuda" else None
