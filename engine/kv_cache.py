"""Paged KV cache: the block manager (pure Python, scheduler side) and the KV tensors (worker side).

The block manager hands out fixed-size blocks from a free list, keeps one block table per
sequence and a reference count per block (shared prefixes hold a block more than once). With
prefix caching on, full blocks are indexed by their contents (engine/prefix_cache.py): a new
sequence starts with the cached blocks of its prefix, and blocks nobody holds stay cached until
their room is needed (least recently used first). It never touches a tensor, so schedulers and
the simulator use it as is.

Sliding windows: when every layer of the model sees only its last `window` keys, a sequence's
leading blocks that no later query can see go back to the pool (`release_outside_window`). Their
table slots keep a placeholder (PLACEHOLDER_BLOCK), so positions still map to slots unchanged;
the attention backends mask those positions (the CPU kernel and Triton skip the blocks, the torch
path and CUDA graphs read them and mask: the placeholder is a real block of finite KV, so the
read is harmless). A released block that the prefix cache indexed is parked like any cached
block nobody holds: its contents stay valid until it is evicted, and eviction drops it from the
index, so a later match never returns reused KV. Models whose windowed layers alternate with
global ones keep one table per layer group instead (group_blocks.GroupedBlockManager).
"""
from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

from . import envs
from .prefix_cache import PrefixIndex

log = logging.getLogger(__name__)

PLACEHOLDER_BLOCK = 0    # what a released table slot points at (masked, never written)
_CHAIN_BROKEN = 1 << 40  # _indexed's count once nothing more of a sequence can be indexed


class BlockManager:
    num_groups = 1   # block tables per sequence (group_blocks.GroupedBlockManager: one per group)
    swap = None      # kv_swap.SwapSpace where preempted sequences swap (set at engine build)

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 prefix_caching: bool = False, hash_fn: Callable[[object], int] = hash,
                 window: int = 0):
        """`window` > 0: every layer sees only its last `window` keys, and blocks wholly before
        every future query's window are released (0: a sequence holds all its blocks)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self.prefix: Optional[PrefixIndex] = PrefixIndex(hash_fn) if prefix_caching else None
        # seq -> (its leading blocks indexed, the cached block that stands for the last of them)
        self._indexed: dict[Hashable, tuple[int, Optional[int]]] = {}
        # blocks being computed right now (admitted, not yet indexed): key -> sequences, and per
        # sequence (index of its first such block, their keys)
        self._computing: dict[int, int] = {}
        self._computing_of: dict[Hashable, tuple[int, list[int]]] = {}
        self.window = window
        self._released: dict[Hashable, int] = {}   # seq -> its leading slots released (window)
        self.window_freed_blocks = 0        # blocks released for sliding windows, in all
        self.peak_seq_blocks = 0            # the most blocks one sequence held after a grow
        self.prefix_queried_tokens = 0      # tokens of admitted sequences (prefix caching on)
        self.prefix_hit_tokens = 0          # ... whose KV came from the cache

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: free ones and cached ones nobody holds."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def table_windows(self) -> tuple[int, ...]:
        """Each of a sequence's block tables' sliding window (0: it keeps the whole context)."""
        return (self.window,)

    def max_concurrency(self, max_model_len: int) -> float:
        """max_model_len-token requests the pool holds at once."""
        return self.capacity_tokens / max_model_len

    def block_table(self, seq_id: Hashable) -> list[int]:
        """One block per slot; slots released for the window hold PLACEHOLDER_BLOCK."""
        return self._tables.get(seq_id, [])

    def group_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The tables of the layer groups after the first (none here: one table)."""
        return []

    def num_held_blocks(self, seq_id: Hashable) -> int:
        """Blocks `seq_id` really holds (its table less the slots released for the window)."""
        return len(self._tables.get(seq_id, ())) - self._released.get(seq_id, 0)

    def tables(self, seq_id: Hashable) -> list[list[int]]:
        """Every block table of `seq_id`, the first one's (block_table) first."""
        return [self.block_table(seq_id), *self.group_tables(seq_id)]

    def released_slots(self, seq_id: Hashable) -> tuple[int, ...]:
        """Per table (as `tables` orders them): its leading slots released behind the window
        (they hold PLACEHOLDER_BLOCK, which is also a real block id: only this count tells)."""
        return (self._released.get(seq_id, 0),)

    def blocks_needed(self, seq_id: Hashable, total_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `total_tokens` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-total_tokens // self.block_size) - have)

    def can_grow(self, seq_id: Hashable, total_tokens: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.blocks_needed(seq_id, total_tokens) <= self.num_free_blocks - reserve

    # --- changes -------------------------------------------------------------------------------
    def grow(self, seq_id: Hashable, total_tokens: int) -> list[int]:
        """Extends the table to cover `total_tokens`; returns the new blocks. Caller checked room."""
        need = self.blocks_needed(seq_id, total_tokens)
        if need > self.num_free_blocks:
            raise MemoryError(f"need {need} KV blocks, {self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        new = [self._take() for _ in range(need)]
        for block in new:
            self._ref[block] = 1
        table.extend(new)
        self.peak_seq_blocks = max(self.peak_seq_blocks, self.num_held_blocks(seq_id))
        return new

    def adopt(self, seq_id: Hashable, slots: int, released: Sequence[int]) -> list[list[int]]:
        """Gives `seq_id` (which holds none) tables of `slots` slots whose first released[t]
        slots of table t are released: the shape a copy of the sequence has in another block
        manager over the same windows (a KV tier). -> its tables. Caller checked room
        (`blocks_for_shape`)."""
        (skip,) = released
        if self._tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already has blocks")
        if skip and not self.window:
            raise ValueError("released slots need a block manager with a window")
        need = slots - skip
        if need > self.num_free_blocks:
            raise MemoryError(f"need {need} KV blocks, {self.num_free_blocks} free")
        new = [self._take() for _ in range(need)]
        for block in new:
            self._ref[block] = 1
        self._tables[seq_id] = [PLACEHOLDER_BLOCK] * skip + new
        if skip:
            self._released[seq_id] = skip
        self.peak_seq_blocks = max(self.peak_seq_blocks, need)
        return self.tables(seq_id)

    @staticmethod
    def blocks_for_shape(slots: int, released: Sequence[int]) -> int:
        """Blocks `adopt(seq, slots, released)` takes."""
        return sum(slots - skip for skip in released)

    def reserve_block(self, owner: Hashable) -> Optional[int]:
        """One block held by `owner` (which holds none) that no sequence uses: the CUDA graphs'
        padding rows write their K/V there. None when no block is free; `free(owner)` returns
        it."""
        if not self.can_grow(owner, 1):
            return None
        return self.grow(owner, 1)[0]

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

    def share_tables(self, seq_id: Hashable, donor: Hashable) -> None:
        """Starts `seq_id` with every block `donor` holds (the step profiler's stand-ins)."""
        self.share(seq_id, list(self.block_table(donor)))

    def free(self, seq_id: Hashable) -> None:
        """Tail blocks first, so that a prefix outlives what followed it in the cache."""
        self._indexed.pop(seq_id, None)
        self._done_computing(seq_id, None)
        released = self._released.pop(seq_id, 0)
        for block in reversed(self._tables.pop(seq_id, [])[released:]):
            self._drop(block)

    def release_outside_window(self, seq_id: Hashable, first_query: int) -> int:
        """Releases `seq_id`'s leading blocks that no query at `first_query` or later can see
        (each sees the keys after position query - window); -> how many it released. Call it
        with the first position not yet computed: a step's queries all start there or later."""
        table = self._tables.get(seq_id)
        if not self.window or not table:
            return 0
        done = self._released.get(seq_id, 0)
        upto = min(max(0, (first_query - self.window + 1) // self.block_size), len(table))
        if upto <= done:
            return 0
        if self.prefix is not None and upto >= self._indexed.get(seq_id, (0, None))[0]:
            # a block not indexed yet can never be (its slot holds the placeholder from now
            # on), and the last indexed block is the next one's parent by block id: once it is
            # released it may be evicted and re-registered with other content. Either way the
            # chain of this sequence ends here
            self._indexed[seq_id] = (_CHAIN_BROKEN, None)
        for i in range(done, upto):
            self._drop(table[i])
            table[i] = PLACEHOLDER_BLOCK
        self._released[seq_id] = upto
        self.window_freed_blocks += upto - done
        return upto - done

    def _drop(self, block: int) -> None:
        """One holder fewer; a block nobody holds is parked if cached, else free."""
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self.prefix is not None and self.prefix.is_cached(block):
                self.prefix.park(block)
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        return self.prefix.evict()

    # --- prefix caching ---------------------------------------------------------------------------
    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int],
                     root: Optional[tuple] = None) -> int:
        """Starts `seq_id`'s table (it has none) with the cached blocks of token_ids' prefix;
        -> the tokens they hold. At least the last token is left to compute: a query is never
        empty. root (here and below): the chain's, Request.prefix_root (a LoRA adapter)."""
        if self.prefix is None:
            return 0
        if self._tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already has blocks")
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        blocks = self.prefix.match(token_ids, self.block_size, max_blocks, root)
        for block in blocks:
            if self._ref[block] == 0:
                self.prefix.unpark(block)
            self._ref[block] += 1
        if blocks:
            self._tables[seq_id] = list(blocks)
        self._indexed[seq_id] = (len(blocks), blocks[-1] if blocks else None)
        return len(blocks) * self.block_size

    def count_admission(self, num_tokens: int, cached_tokens: int) -> None:
        """A sequence started with `cached_tokens` of its `num_tokens` from the cache."""
        self.prefix_queried_tokens += num_tokens
        self.prefix_hit_tokens += cached_tokens

    def _next_keys(self, seq_id: Hashable, token_ids: Sequence[int],
                   count: Optional[int] = None, root: Optional[tuple] = None
                   ) -> tuple[int, list[int]]:
        """(index, keys) of the full blocks of token_ids after those `seq_id` matched."""
        done, last = self._indexed.get(seq_id, (0, None))
        full = len(token_ids) // self.block_size
        count = full - done if count is None else min(count, full - done)
        parent_key = self.prefix.key_of(last) if last is not None else root
        return done, self.prefix.chain_keys(token_ids, self.block_size, done, max(count, 0),
                                            parent_key)

    def start_computing(self, seq_id: Hashable, token_ids: Sequence[int],
                        root: Optional[tuple] = None) -> None:
        """`seq_id` was admitted to compute token_ids past its cached prefix: until their
        blocks are indexed, a sequence that needs the same blocks can wait for them."""
        if self.prefix is None:
            return
        first, keys = self._next_keys(seq_id, token_ids, root=root)
        self._computing_of[seq_id] = (first, keys)
        for key in keys:
            self._computing[key] = self._computing.get(key, 0) + 1

    def computing_elsewhere(self, seq_id: Hashable, token_ids: Sequence[int],
                            root: Optional[tuple] = None) -> bool:
        """Whether the first block of token_ids past `seq_id`'s cached prefix (a full block
        before its last token) is being computed by a running sequence."""
        if self.prefix is None or not self._computing:
            return False
        done, _ = self._indexed.get(seq_id, (0, None))
        if (done + 1) * self.block_size > len(token_ids) - 1:
            return False
        _, keys = self._next_keys(seq_id, token_ids, 1, root)
        return bool(keys) and keys[0] in self._computing

    def computed(self, seq_id: Hashable, num_computed: int) -> None:
        """`seq_id`'s first `num_computed` tokens' KV is written (a step came back)."""
        if seq_id in self._computing_of:
            self._done_computing(seq_id, num_computed // self.block_size)

    def _done_computing(self, seq_id: Hashable, upto: Optional[int]) -> None:
        """The blocks of `seq_id` before block `upto` (None: all) are no longer being computed."""
        first, keys = self._computing_of.pop(seq_id, (0, []))
        cut = len(keys) if upto is None else max(0, min(upto - first, len(keys)))
        for key in keys[:cut]:
            left = self._computing[key] - 1
            if left:
                self._computing[key] = left
            else:
                del self._computing[key]
        if cut < len(keys):
            self._computing_of[seq_id] = (first + cut, keys[cut:])

    def has_uncached_blocks(self, seq_id: Hashable, num_computed: int) -> bool:
        """Whether cache_computed has full blocks of `seq_id` to index (cheap; no tokens)."""
        if self.prefix is None:
            return False
        full = min(num_computed // self.block_size, len(self._tables.get(seq_id, ())))
        return full > self._indexed.get(seq_id, (0, None))[0]

    def cache_computed(self, seq_id: Hashable, token_ids: Sequence[int],
                       num_computed: int, root: Optional[tuple] = None) -> None:
        """Indexes `seq_id`'s full blocks whose `num_computed` leading tokens' KV is written."""
        if not self.has_uncached_blocks(seq_id, num_computed):
            return
        table = self._tables[seq_id]
        full = min(num_computed // self.block_size, len(table))
        done, parent = self._indexed.get(seq_id, (0, None))
        for i in range(done, full):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = self.prefix.register(table[i], parent, tokens, root)
            if parent is None:      # the chain's cached parent was evicted: nothing after it
                self._indexed[seq_id] = (_CHAIN_BROKEN, None)
                return
        self._indexed[seq_id] = (full, parent)

    def scatter_free(self, count: int, seed: int = 0) -> None:
        """Shuffles the next `count` free blocks: after a while of running, sequences that grew
        a block at a time and finished in any order leave the free list scattered, and attention
        over scattered blocks is slower (the profiler lays its probes out this way)."""
        head = [self._free.popleft() for _ in range(min(count, len(self._free)))]
        random.Random(seed).shuffle(head)
        self._free.extendleft(reversed(head))

    def check_invariants(self) -> None:
        """Every block is held exactly refcount times, or (refcount 0) either on the free list,
        not cached, or parked in the prefix cache, never both."""
        held: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            released = self._released.get(seq_id, 0)
            assert all(block == PLACEHOLDER_BLOCK for block in table[:released]), \
                f"{seq_id!r}: a released slot holds a block"
            for block in table[released:]:
                held[block] = held.get(block, 0) + 1
        assert set(self._released) <= set(self._tables), "released slots of a freed sequence"
        self._check_pool(held)

    def _check_pool(self, held: dict[int, int]) -> None:
        """Each block's refcount is what the tables hold (`held`); an unheld block is free or
        parked in the prefix cache, never both, and a free block is not cached."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            count = held.get(block, 0)
            assert self._ref[block] == count, f"block {block}: ref {self._ref[block]} != held {count}"
            parked = self.prefix is not None and self.prefix.is_evictable(block)
            cached = self.prefix is not None and self.prefix.is_cached(block)
            assert (block in free) + parked == (count == 0), f"block {block}: free state is wrong"
            assert not (block in free and cached), f"block {block}: free but still cached"
            assert not parked or cached, f"block {block}: parked but not cached"


def log_kv_window(window: int) -> None:
    """The start-up log's line for a block manager that releases blocks behind a window."""
    if window:
        log.info("KV cache: every layer has a sliding window of %d keys: a sequence's blocks "
                 "behind it are released (memory.free_outside_window)", window)


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


HUGE_PAGE = 2 << 20
TOUCH_BYTES = 256 << 20     # the KV cache's first touch, a piece at a time


def _huge_page_storage(shape: tuple, dtype):
    """Zeroed host memory backed by transparent huge pages where the kernel allows them (a private
    anonymous mapping, 2 MiB aligned, madvise(MADV_HUGEPAGE) before the first touch, then touched
    once here so no page fault lands inside a run). None where mmap cannot give it."""
    import mmap

    import torch

    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:
        log.debug("no huge pages for the KV cache: %s", exc)
        return None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    flat = raw[start:start + nbytes]
    # touched a piece at a time: faulting in GiBs takes seconds, and a signal's handler (a stop
    # during setup) runs between pieces, not only after the last
    for offset in range(0, nbytes, TOUCH_BYTES):
        flat[offset:offset + TOUCH_BYTES].zero_()
    return flat.view(dtype).view(shape)


def _anon_huge_page_bytes() -> int:
    """This process's anonymous memory in transparent huge pages (0 where Linux doesn't say)."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def allocate_kv_tensors(spec: KVCacheSpec, dtype, device) -> list[tuple]:
    """One (key, value) pair of [num_blocks, kv_heads, block_size, head_dim] tensors per layer.
    On CPU in transparent huge pages (BATCHINFER_KV_HUGE_PAGES=0: plain pages): decode attention
    reads every cached token each step from blocks scattered over the cache, and 4 KiB pages cost
    it a TLB miss per page (W-decode: 1.02-1.08x output tok/s in-process,
    benchmarks/probes/kv_huge_pages_ab.py; zeroing 4 GiB at start took 0.2-1.3 s longer)."""
    import torch

    shape = (spec.num_layers, 2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    storage = None
    if torch.device(device).type == "cpu" and not envs.is_off("BATCHINFER_KV_HUGE_PAGES"):
        before = _anon_huge_page_bytes()
        storage = _huge_page_storage(shape, dtype)
        if storage is not None:
            log.info("KV cache: %.0f of %.0f MiB in transparent huge pages",
                     (_anon_huge_page_bytes() - before) / 2**20, storage.nbytes / 2**20)
    if storage is None:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(spec.num_layers)]
