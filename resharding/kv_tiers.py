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
from batchinfer.engine.kv_groups import blocks_held

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
    table_blocks: tuple[int, ...] = ()     # the blocks of each table, in the order listed


class KVTiers:
    """With KV layer groups both tiers are block managers over the same groups' windows (a
    block serves one group: kv_groups.py, kv_store.py), a sequence has a table per group in
    each, and a move pairs the blocks its windows still hold, listing how many each table has
    (`Transfer.table_blocks`: which group each block's layers are): a windowed group's slots
    released behind the window are released in the other tier too and never copied."""

    def __init__(self, device: BlockManager, store: BlockManager):
        if device.block_size != store.block_size:
            raise ValueError(f"the CPU store's block size ({store.block_size}) must equal the "
                             f"paged cache's ({device.block_size})")
        if device.table_windows != store.table_windows:
            raise ValueError(f"the CPU store's tables (windows {store.table_windows}) must be "
                             f"the paged cache's ({device.table_windows})")
        self.device, self.store = device, store
        self.pending: dict[int, Transfer] = {}
        self._next_id = 0
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0
        self.peak_store_blocks = 0     # the most store blocks held at once

    def store_blocks_for(self, num_tokens: int) -> int:
        """Blocks (in either tier) of a sequence of `num_tokens` computed tokens, its windowed
        tables released behind its next query."""
        return blocks_held(self.store.table_windows, num_tokens, self.store.block_size)

    def can_swap_out(self, num_tokens: int, reserved_blocks: int = 0) -> bool:
        return self.store_blocks_for(num_tokens) + reserved_blocks <= self.store.num_free_blocks

    def can_swap_in(self, num_tokens: int, keep_free_sequences: int = 0) -> bool:
        """Room on the device for the sequence and a block of every table of
        `keep_free_sequences` sequences (their next block_size steps cannot run out)."""
        keep = keep_free_sequences * self.device.num_groups
        return self.store_blocks_for(num_tokens) + keep <= self.device.num_free_blocks

    def swap_out(self, request_id: str, num_tokens: int) -> Transfer:
        """Starts moving the KV of `request_id` (held on the device) into the store."""
        return self._move(SWAP_OUT, self.device, "device", self.store, "CPU store", request_id,
                          num_tokens)

    def swap_in(self, request_id: str, num_tokens: int) -> Transfer:
        """Starts moving the KV of `request_id` (in the store) onto the device."""
        return self._move(SWAP_IN, self.store, "CPU store", self.device, "device", request_id,
                          num_tokens)

    def _move(self, kind, source: BlockManager, source_name: str, dest: BlockManager,
              dest_name: str, request_id: str, num_tokens: int) -> Transfer:
        """The destination takes the source's table shape for `num_tokens` tokens; the move
        pairs their held blocks, table by table."""
        slots = -(-num_tokens // source.block_size)
        if len(source.block_table(request_id)) < slots:
            raise ValueError(f"{request_id!r} holds {len(source.block_table(request_id))} "
                             f"{source_name} blocks a table, too few for {num_tokens} tokens")
        if dest.block_table(request_id):
            raise ValueError(f"{request_id!r} already has {dest_name} blocks")
        released = tuple(min(skip, slots) for skip in source.released_slots(request_id))
        dest.adopt(request_id, slots, released)
        if kind == SWAP_OUT:
            self.peak_store_blocks = max(self.peak_store_blocks,
                                         self.store.num_blocks - self.store.num_free_blocks)
        held = held_tables(source, request_id, slots)
        moved = _flat(held), held_blocks(dest, request_id, slots)
        device_blocks, store_blocks = moved if kind == SWAP_OUT else moved[::-1]
        transfer = Transfer(self._next_id, kind, request_id, num_tokens, device_blocks,
                            store_blocks, tuple(len(table) for table in held))
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
            slots = -(-transfer.num_tokens // self.store.block_size)
            assert held_blocks(self.store, transfer.request_id, slots) == transfer.store_blocks
            assert held_blocks(self.device, transfer.request_id, slots) == transfer.device_blocks
            assert sum(transfer.table_blocks) == len(transfer.device_blocks)


def held_tables(manager: BlockManager, request_id: str, slots: int) -> list[list[int]]:
    """Per table, the blocks `request_id` holds in its first `slots` slots (released slots
    left out)."""
    return [table[skip:slots] for table, skip in zip(manager.tables(request_id),
                                                     manager.released_slots(request_id))]


def held_blocks(manager: BlockManager, request_id: str, slots: int) -> tuple[int, ...]:
    """held_tables, table after table: the order both tiers' halves of a move list them in."""
    return _flat(held_tables(manager, request_id, slots))


def _flat(tables: list[list[int]]) -> tuple[int, ...]:
    return tuple(block for table in tables for block in table)
