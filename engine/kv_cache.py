"""Paged KV cache: the block manager (pure Python, scheduler side) and the KV tensors (worker side).

The block manager hands out fixed-size blocks from a free list, keeps one block table per
sequence and a reference count per block (shared prefixes hold a block more than once). It never
touches a tensor, so schedulers and the simulator use it as is.
"""
from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Hashable

log = logging.getLogger(__name__)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, seq_id: Hashable, total_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `total_tokens` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-total_tokens // self.block_size) - have)

    def can_grow(self, seq_id: Hashable, total_tokens: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.blocks_needed(seq_id, total_tokens) <= len(self._free) - reserve

    # --- changes -------------------------------------------------------------------------------
    def grow(self, seq_id: Hashable, total_tokens: int) -> list[int]:
        """Extends the table to cover `total_tokens`; returns the new blocks. Caller checked room."""
        need = self.blocks_needed(seq_id, total_tokens)
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        new = [self._free.popleft() for _ in range(need)]
        for block in new:
            self._ref[block] = 1
        table.extend(new)
        return new

    def share(self, seq_id: Hashable, blocks: list[int]) -> None:
        """Starts `seq_id`'s table with blocks another sequence holds (reference counted)."""
        table = self._tables.setdefault(seq_id, [])
        if table:
            raise ValueError(f"{seq_id!r} already has blocks")
        for block in blocks:
            if self._ref[block] <= 0:
                raise ValueError(f"block {block} is free and cannot be shared")
            self._ref[block] += 1
        table.extend(blocks)

    def free(self, seq_id: Hashable) -> None:
        for block in self._tables.pop(seq_id, ()):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free.append(block)

    def scatter_free(self, count: int, seed: int = 0) -> None:
        """Shuffles the next `count` free blocks: after a while of running, sequences that grew
        a block at a time and finished in any order leave the free list scattered, and attention
        over scattered blocks is slower (the profiler lays its probes out this way)."""
        head = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        random.Random(seed).shuffle(head)
        self._free.extendleft(reversed(head))

    def check_invariants(self) -> None:
        """Every block is either free with refcount 0 or held exactly refcount times."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                held[block] = held.get(block, 0) + 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            count = held.get(block, 0)
            assert self._ref[block] == count, f"block {block}: ref {self._ref[block]} != held {count}"
            assert (block in free) == (count == 0), f"block {block}: free-list state is wrong"


@dataclass(frozen=True)
class KVCacheSpec:
    """How many blocks of what shape: decided once, from the memory budget."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.dtype_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def from_budget(cls, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                    head_dim: int, dtype_bytes: int) -> "KVCacheSpec":
        per_block = 2 * num_layers * num_kv_heads * block_size * head_dim * dtype_bytes
        return cls(num_layers, max(0, budget_bytes // per_block), block_size, num_kv_heads,
                   head_dim, dtype_bytes)


def allocate_kv_tensors(spec: KVCacheSpec, dtype, device) -> list[tuple]:
    """One (key, value) pair of [num_blocks, kv_heads, block_size, head_dim] tensors per layer."""
    import torch

    shape = (spec.num_layers, 2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(spec.num_layers)]
