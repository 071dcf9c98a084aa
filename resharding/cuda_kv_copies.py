"""Seesaw's KV copies on CUDA, off the compute stream (paper §5.2: GPU -> pinned -> shared memory).

A rank's copies between its paged cache and the CPU store run on one dedicated copy stream,
through two pinned staging buffers allocated once per rank (grown only if a layout's block is
bigger than they are) and used in turn, so the device-to-host copy of one chunk of blocks runs
while the host moves the previous chunk between staging and the store. Ordering is by CUDA
events, never a device-wide sync:

- the worker's main thread records `mark()` on its compute stream when a copy is submitted; the
  copy stream waits for that event, so a swap-out reads a prompt's KV only after the kernels that
  wrote it, and a swap-in overwrites free blocks only after the kernels issued before it are done
  with them;
- the prefetcher thread waits on the copy stream's own events (its host side of a chunk, and the
  end of the transfer before it reports it), so the compute stream is never stalled.

The controller lets a sequence decode (swap-in) or frees its device blocks (swap-out) only after
the report, so nothing on the compute stream touches a block while its copy is in flight.

If pinned memory cannot be allocated the staging buffers are pageable (one warning): the copies
are then synchronous with the host but still off the compute stream.
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch

from batchinfer.engine.host_to_device import pinned

from .kv_store import ShardView, covers_shard, groups_of_blocks, slot_pairs

log = logging.getLogger("batchinfer")

STAGING_BYTES = 64 << 20          # each of the two buffers; a chunk is as many blocks as fit


class CudaKvCopier:
    def __init__(self, device: torch.device, staging_bytes: int = STAGING_BYTES):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.staging_bytes = staging_bytes
        self.pinned = True
        self._buffers: list[Optional[torch.Tensor]] = [None, None]
        self._in_use: list[Optional[torch.cuda.Event]] = [None, None]   # last copy reading each
        self.chunks = 0                                                  # for the tests / report

    def mark(self) -> torch.cuda.Event:
        """An event on the calling thread's current stream: what the next copy waits for."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def swap_out(self, store: torch.Tensor, paged: torch.Tensor, view: ShardView,
                 device_blocks: list[int], store_blocks: list[int],
                 after: Optional[torch.cuda.Event], table_blocks: Sequence[int] = ()) -> None:
        """paged [layers, 2, blocks, heads, bs, D] blocks -> the store's slice, chunk by chunk:
        chunk i's device-to-host copy is in flight while chunk i-1 goes from staging to the
        store (with KV layer groups only each block's group's slots: kv_store.py)."""
        self._wait(after)
        shape = _block_shape(paged)
        groups = groups_of_blocks(view, device_blocks, table_blocks)
        landed: Optional[tuple] = None
        for i, (dev, sto, grp) in enumerate(self._chunks(paged, device_blocks, store_blocks,
                                                         groups)):
            slot = i % 2
            staged = self._staging(slot, len(dev), shape, paged.dtype)
            with torch.cuda.stream(self.stream):
                index = _device_index(dev, self.device)
                gathered = paged.permute(2, 0, 1, 3, 4, 5)[index]          # [n, L, 2, H, bs, D]
                staged.copy_(gathered, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._in_use[slot] = done
            if landed is not None:
                landed[0].synchronize()
                to_store(store, view, *landed[1:])
            landed = (done, staged, sto, grp)
        if landed is not None:
            landed[0].synchronize()
            to_store(store, view, *landed[1:])

    def swap_in(self, store: torch.Tensor, paged: torch.Tensor, view: ShardView,
                device_blocks: list[int], store_blocks: list[int],
                after: Optional[torch.cuda.Event], table_blocks: Sequence[int] = ()) -> None:
        """The store's slice -> paged blocks: the host fills one staging buffer while the other's
        host-to-device copy runs; returns once the last copy has landed (the copy stream's event,
        not a device sync). With KV layer groups a block's slots its group does not use on this
        rank get zeros (`from_store`)."""
        self._wait(after)
        shape = _block_shape(paged)
        groups = groups_of_blocks(view, device_blocks, table_blocks)
        for i, (dev, sto, grp) in enumerate(self._chunks(paged, device_blocks, store_blocks,
                                                         groups)):
            slot = i % 2
            staged = self._staging(slot, len(dev), shape, paged.dtype)
            from_store(store, view, staged, sto, grp)    # one pass, straight into staging
            with torch.cuda.stream(self.stream):
                moved = staged.to(self.device, non_blocking=True)     # [n, L, 2, H, bs, D]
                paged.index_copy_(2, _device_index(dev, self.device), moved.permute(1, 2, 0, 3, 4, 5))
                done = torch.cuda.Event()
                done.record(self.stream)
            self._in_use[slot] = done
        for event in self._in_use:
            if event is not None:
                event.synchronize()

    def _wait(self, after: Optional[torch.cuda.Event]) -> None:
        if after is not None:
            self.stream.wait_event(after)

    def _chunks(self, paged: torch.Tensor, device_blocks: list[int], store_blocks: list[int],
                groups: list[int]):
        block_bytes = paged[:, :, 0].numel() * paged.element_size()
        per_chunk = max(1, self.staging_bytes // block_bytes)
        for start in range(0, len(device_blocks), per_chunk):
            self.chunks += 1
            end = start + per_chunk
            yield device_blocks[start:end], store_blocks[start:end], groups[start:end]

    def _staging(self, slot: int, blocks: int, block_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Staging buffer `slot` viewed as [blocks, *block_shape] of dtype, once the copy that last
        read it is done; allocated at first use (and again only for a bigger block)."""
        if self._in_use[slot] is not None:
            self._in_use[slot].synchronize()
            self._in_use[slot] = None
        nbytes = blocks * math.prod(block_shape) * dtype.itemsize
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[slot] = self._allocate(max(self.staging_bytes, nbytes))
        return buffer[:nbytes].view(dtype).view(blocks, *block_shape)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                self.pinned = False
                log.warning("Seesaw: pinned staging memory could not be allocated (%s); KV copies "
                            "go through pageable memory, synchronously with the prefetcher", exc)
        return torch.empty(nbytes, dtype=torch.uint8)


def to_store(store: torch.Tensor, view: ShardView, staged: torch.Tensor,
             store_blocks: list[int], groups: list[int]) -> None:
    """Staged blocks [n, the rank's slots, 2, heads, bs, D] (landed) -> their store blocks, each
    block's group's slots only (host work, run while the next chunk's copy is in flight)."""
    heads = slice(view.head_start, view.head_end)
    for row, (block, group) in enumerate(zip(store_blocks, groups)):
        for stored, device in slot_pairs(view, group):
            store[block, stored, :, heads].copy_(staged[row, device])


def from_store(store: torch.Tensor, view: ShardView, staged: torch.Tensor,
               store_blocks: list[int], groups: list[int]) -> None:
    """The store blocks' slots this rank holds -> staging rows (to_store's inverse). A row's
    slots its block's group does not use here are zeroed: the whole row lands in the paged
    cache, and a slot the block serves once it is another group's must not read leftover bytes
    of the pinned buffer (NaN patterns survive the attention's mask as 0 x NaN)."""
    heads = slice(view.head_start, view.head_end)
    for row, (block, group) in enumerate(zip(store_blocks, groups)):
        if not covers_shard(view, group, staged.shape[1]):
            staged[row].zero_()
        for stored, device in slot_pairs(view, group):
            staged[row, device].copy_(store[block, stored, :, heads])


def _block_shape(paged: torch.Tensor) -> tuple:
    """One block of the paged buffer as the store holds it: [layers, 2, heads, bs, D]."""
    layers, two, _, heads, block_size, head_dim = paged.shape
    return (layers, two, heads, block_size, head_dim)


def _device_index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device: a small pinned copy (host_to_device.pinned: pageable where
    pinning fails) on the current (copy) stream."""
    return pinned(torch.tensor(blocks, dtype=torch.long)).to(device, non_blocking=True)
