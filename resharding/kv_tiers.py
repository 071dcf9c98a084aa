"""Seesaw's tiered KV cache, controller side: which tier holds each sequence's KV, and the moves.

Two allocators over blocks of the same token size: the device-side paged cache (the engine's
BlockManager) and the CPU store (its own BlockManager over the store's blocks: free list, block
tables, reference counts; no tensors). A move (a `Transfer`) holds its blocks in both tiers until
every rank has copied it, so neither side's blocks are handed out again while a copy reads or
writes them. Pure Python: the scheduler, the simulator and the tests use it as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchinfer.engine.kv_cache import BlockManager

SWAP_OUT, SWAP_IN = "out", "in"


@dataclass(frozen=True)
class Transfer:
    """Copy `num_tokens` tokens of KV of `request_id` between its device blocks and its store
    blocks: `out` = device -> store (after prefill, or when decode hands the device back),
    `in` = store -> device (the prefetcher, before the sequence decodes)."""

    transfer_id: int
    kind: Literal["out", "in"]
    request_id: str
    num_tokens: int
    device_blocks: tuple[int, ...]
    store_blocks: tuple[int, ...]


class KVTiers:
    def __init__(self, device: BlockManager, store: BlockManager):
        if device.block_size != store.block_size:
            raise ValueError(f"the CPU store's block size ({store.block_size}) must equal the "
                             f"paged cache's ({device.block_size})")
        self.device, self.store = device, store
        self.pending: dict[int, Transfer] = {}
        self._next_id = 0
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0
        self.peak_store_blocks = 0     # the most store blocks held at once

    def store_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.store.block_size)

    def can_swap_out(self, num_tokens: int, reserved_blocks: int = 0) -> bool:
        return self.store_blocks_for(num_tokens) + reserved_blocks <= self.store.num_free_blocks

    def can_swap_in(self, num_tokens: int, keep_free_blocks: int = 0) -> bool:
        return self.store_blocks_for(num_tokens) + keep_free_blocks <= self.device.num_free_blocks

    def swap_out(self, request_id: str, num_tokens: int) -> Transfer:
        """Starts moving the KV of `request_id` (held on the device) into the store."""
        device_blocks = _move(self.device, "device", self.store, "CPU store", request_id,
                              num_tokens)
        store_blocks = self.store.grow(request_id, num_tokens)
        self.peak_store_blocks = max(self.peak_store_blocks,
                                     self.store.num_blocks - self.store.num_free_blocks)
        need = self.store_blocks_for(num_tokens)
        return self._start(SWAP_OUT, request_id, num_tokens, device_blocks[:need], store_blocks)

    def swap_in(self, request_id: str, num_tokens: int) -> Transfer:
        """Starts moving the KV of `request_id` (in the store) onto the device."""
        store_blocks = _move(self.store, "CPU store", self.device, "device", request_id,
                             num_tokens)
        device_blocks = self.device.grow(request_id, num_tokens)
        return self._start(SWAP_IN, request_id, num_tokens, device_blocks, store_blocks)

    def _start(self, kind, request_id, num_tokens, device_blocks, store_blocks) -> Transfer:
        transfer = Transfer(self._next_id, kind, request_id, num_tokens, tuple(device_blocks),
                            tuple(store_blocks))
        self._next_id += 1
        self.pending[transfer.transfer_id] = transfer
        return transfer

    def complete(self, transfer_id: int) -> Transfer:
        """Every rank copied it: the source tier's blocks go back to their free list."""
        transfer = self.pending.pop(transfer_id)
        if transfer.kind == SWAP_OUT:
            self.device.free(transfer.request_id)
            self.swapped_out_tokens += transfer.num_tokens
        else:
            self.store.free(transfer.request_id)
            self.swapped_in_tokens += transfer.num_tokens
        return transfer

    @property
    def num_transfers(self) -> int:
        """Moves started so far, either way."""
        return self._next_id

    def is_moving(self, request_id: str) -> bool:
        return any(t.request_id == request_id for t in self.pending.values())

    def free(self, request_id: str) -> None:
        """Drops a sequence's KV from both tiers (finished or aborted; never while it moves)."""
        if self.is_moving(request_id):
            raise ValueError(f"{request_id!r} is being copied between tiers")
        self.device.free(request_id)
        self.store.free(request_id)

    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.store.check_invariants()
        for transfer in self.pending.values():
            assert tuple(self.store.block_table(transfer.request_id)) == transfer.store_blocks
            held = self.device.block_table(transfer.request_id)
            assert tuple(held[:len(transfer.device_blocks)]) == transfer.device_blocks


def _move(source: BlockManager, source_name: str, dest: BlockManager, dest_name: str,
          request_id: str, num_tokens: int) -> list[int]:
    """The source blocks of a move, checked: they hold `num_tokens`, the destination holds none."""
    blocks = source.block_table(request_id)
    if len(blocks) * source.block_size < num_tokens:
        raise ValueError(f"{request_id!r} holds {len(blocks)} {source_name} blocks, too few for "
                         f"{num_tokens} tokens")
    if dest.block_table(request_id):
        raise ValueError(f"{request_id!r} already has {dest_name} blocks")
    return blocks
